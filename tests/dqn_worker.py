"""PureJaxRL's DQN (purejaxrl/dqn.py: gymnax CartPole-v1 under its LogWrapper, a flashbax
flat buffer, epsilon-greedy Q-learning with a target network) for the end-to-end tests of
tests/test_dqn_resume.py and benchmarks/dqn_saves.py, with a replay buffer of 262 MiB.

    python tests/dqn_worker.py DIR MODE [KILL_AT DELAY]

MODE: "incremental" (`Checkpointer(incremental=True)`) or "whole". The buffer is part of
the saved state, and its size is honest: CartPole's observations as they are (4 float32),
a capacity of 11,000,000 transitions (`BUFFER_SIZE`, 1,100,000 per environment; 25 bytes
each: observation, action, reward, done) instead of PureJaxRL's 10,000. The rest is
PureJaxRL's configuration for CartPole, except `LEARNING_STARTS` (1,000 steps, not
10,000, so that the run learns within its updates) and the network's initializer (below).

As a script it trains in the recommended shape: `ckpt.restore_or_init` gives the state
(restored, or initialised in a jitted call of its own) and its step, and one jitted
function receives both (`lax.fori_loop` from that step: a fresh run and a resumed one are
one compiled program), with `ckpt.maybe_save` after every update. With KILL_AT the
process SIGKILLs itself DELAY seconds after update KILL_AT is done and the save before
the last one is on disk (from a host callback every update makes, so that the program is
the same with or without a kill; the writer keeps writing during DELAY, so the kill lands
at whatever point of a save it has reached). Run it again on the same DIR to resume. At
the end it prints one JSON line: the saves' records (`ckpt.stats.recent`), the state's
size, the training's wall time and a digest of the final state, then "done".
"""

import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import chex  # noqa: E402
import flashbax as fbx  # noqa: E402
import flax.linen as nn  # noqa: E402
import gymnax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import struct  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import jax_cb_ckpt  # noqa: E402

NUM_ENVS = 10
BUFFER_SIZE = 11_000_000  # 25 bytes a transition: 275 MB (262 MiB) of buffer
BUFFER_BATCH_SIZE = 128
LEARNING_STARTS = 1_000
TRAINING_INTERVAL = 10
TARGET_UPDATE_INTERVAL = 500
EPSILON_START, EPSILON_FINISH, EPSILON_ANNEAL_TIME = 1.0, 0.05, 25e4
LR, GAMMA, TAU = 2.5e-4, 0.99, 1.0

NUM_UPDATES = 800  # env steps: NUM_UPDATES * NUM_ENVS
EVERY = 100
KILL = [0, 0.0]  # (the update after which the process dies, seconds to wait first)
DIRECTORY = [""]


class QNetwork(nn.Module):
    # lecun_normal (flax's default), as PureJaxRL's DQN; written out for the reader.
    action_dim: int

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = nn.relu(nn.Dense(120, kernel_init=init)(x))
        x = nn.relu(nn.Dense(84, kernel_init=init)(x))
        return nn.Dense(self.action_dim, kernel_init=init)(x)


@chex.dataclass(frozen=True)
class TimeStep:
    obs: chex.Array
    action: chex.Array
    reward: chex.Array
    done: chex.Array


class CustomTrainState(TrainState):
    target_network_params: Any
    timesteps: jax.Array
    n_updates: jax.Array


@struct.dataclass
class LogEnvState:
    """PureJaxRL's LogWrapper state (episode statistics beside the env's state)."""

    env_state: Any
    episode_returns: jax.Array
    episode_lengths: jax.Array
    returned_episode_returns: jax.Array
    returned_episode_lengths: jax.Array
    timestep: jax.Array


ENV, ENV_PARAMS = gymnax.make("CartPole-v1")
NETWORK = QNetwork(action_dim=ENV.action_space(ENV_PARAMS).n)
TX = optax.adam(learning_rate=LR)
BUFFER = fbx.make_flat_buffer(
    max_length=BUFFER_SIZE,
    min_length=BUFFER_BATCH_SIZE,
    sample_batch_size=BUFFER_BATCH_SIZE,
    add_sequences=False,
    add_batch_size=NUM_ENVS,
)


def env_reset(key):
    obs, state = ENV.reset(key, ENV_PARAMS)
    zero, zero_i = jnp.float32(0), jnp.int32(0)
    return obs, LogEnvState(state, zero, zero_i, zero, zero_i, zero_i)


def env_step(key, state, action):
    """PureJaxRL's LogWrapper.step. gymnax 1.0 says `terminated` and `truncated` where
    the gymnax PureJaxRL was written for said `done`, their `or`."""
    obs, env_state, reward, terminated, truncated, info = ENV.step(
        key, state.env_state, action, ENV_PARAMS
    )
    done = terminated | truncated
    new_return = state.episode_returns + reward
    new_length = state.episode_lengths + 1
    state = LogEnvState(
        env_state=env_state,
        episode_returns=new_return * (1 - done),
        episode_lengths=new_length * (1 - done),
        returned_episode_returns=jnp.where(done, new_return, state.returned_episode_returns),
        returned_episode_lengths=jnp.where(done, new_length, state.returned_episode_lengths),
        timestep=state.timestep + 1,
    )
    return obs, state, reward, done, info


def init(rng):
    """The runner state `(train_state, buffer_state, env_state, last_obs, rng)`."""
    rng, k_env, k_net = jax.random.split(rng, 3)
    obs, env_state = jax.vmap(env_reset)(jax.random.split(k_env, NUM_ENVS))
    dummy = jax.random.key(0)
    _obs, _state = env_reset(dummy)
    _action = ENV.action_space(ENV_PARAMS).sample(dummy)
    _obs, _, _reward, _done, _ = env_step(dummy, _state, _action)
    buffer_state = BUFFER.init(TimeStep(obs=_obs, action=_action, reward=_reward, done=_done))
    params = NETWORK.init(k_net, jnp.zeros(ENV.observation_space(ENV_PARAMS).shape))
    train_state = CustomTrainState.create(
        apply_fn=NETWORK.apply,
        params=params,
        target_network_params=jax.tree.map(jnp.copy, params),
        tx=TX,
        timesteps=jnp.int32(0),
        n_updates=jnp.int32(0),
    )
    return train_state, buffer_state, env_state, obs, rng


def eps_greedy(rng, q_vals, t):
    rng_a, rng_e = jax.random.split(rng)
    slope = (EPSILON_FINISH - EPSILON_START) / EPSILON_ANNEAL_TIME
    eps = jnp.clip(slope * t + EPSILON_START, EPSILON_FINISH)
    greedy = jnp.argmax(q_vals, axis=-1)
    random = jax.random.randint(rng_a, greedy.shape, 0, q_vals.shape[-1])
    return jnp.where(jax.random.uniform(rng_e, greedy.shape) < eps, random, greedy)


def learn(train_state, buffer_state, rng):
    batch = BUFFER.sample(buffer_state, rng).experience
    q_next = jnp.max(NETWORK.apply(train_state.target_network_params, batch.second.obs), -1)
    target = batch.first.reward + (1 - batch.first.done) * GAMMA * q_next

    def loss_fn(params):
        q_vals = NETWORK.apply(params, batch.first.obs)
        chosen = jnp.take_along_axis(q_vals, batch.first.action[:, None], axis=-1)[:, 0]
        return jnp.mean((chosen - target) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(train_state.params)
    train_state = train_state.apply_gradients(grads=grads)
    return train_state.replace(n_updates=train_state.n_updates + 1), loss


def update(runner_state):
    """PureJaxRL's `_update_step`: one env step of every environment, the transitions
    added to the buffer, a learning step on a sampled batch, the target network's update."""
    train_state, buffer_state, env_state, last_obs, rng = runner_state
    rng, rng_a, rng_s, rng_l = jax.random.split(rng, 4)
    q_vals = NETWORK.apply(train_state.params, last_obs)
    action = eps_greedy(rng_a, q_vals, train_state.timesteps)
    keys = jax.random.split(rng_s, NUM_ENVS)
    obs, env_state, reward, done, _ = jax.vmap(env_step)(keys, env_state, action)
    train_state = train_state.replace(timesteps=train_state.timesteps + NUM_ENVS)
    step = TimeStep(obs=last_obs, action=action, reward=reward, done=done)
    buffer_state = BUFFER.add(buffer_state, step)
    is_learn_time = (
        BUFFER.can_sample(buffer_state)
        & (train_state.timesteps > LEARNING_STARTS)
        & (train_state.timesteps % TRAINING_INTERVAL == 0)
    )
    train_state, _ = jax.lax.cond(
        is_learn_time,
        lambda ts: learn(ts, buffer_state, rng_l),
        lambda ts: (ts, jnp.float32(0.0)),
        train_state,
    )
    train_state = jax.lax.cond(
        train_state.timesteps % TARGET_UPDATE_INTERVAL == 0,
        lambda ts: ts.replace(
            target_network_params=optax.incremental_update(ts.params, ts.target_network_params, TAU)
        ),
        lambda ts: ts,
        train_state,
    )
    return train_state, buffer_state, env_state, obs, rng


def _die_after(done):
    """After update KILL[0]: wait until the save before the last one is on disk, then
    KILL[1] seconds (the writer goes on meanwhile), then die."""
    if int(done) != KILL[0]:
        return
    while (jax_cb_ckpt.latest_step(DIRECTORY[0]) or 0) < (KILL[0] // EVERY - 1) * EVERY:
        time.sleep(0.01)
    time.sleep(KILL[1])
    os.kill(os.getpid(), signal.SIGKILL)


def make_train(ckpt, *, saves=True, killable=True):
    """`train(state, start, end)`: the updates from `start` to `end`, one jitted call
    (`state` donated). `saves`: `maybe_save` after every update; `killable`: the host
    callback after every update that can kill the process (KILL)."""

    def body(i, state):
        state = update(state)
        if saves:
            ckpt.maybe_save(state, i + 1)  # after update i: i + 1 updates done
        if killable:
            jax.debug.callback(_die_after, i + 1)
        return state

    def train(state, start, end):
        return jax.lax.fori_loop(start, end, body, state)

    return jax.jit(train, donate_argnums=0)


def like():
    """The state's shapes and types, for a restore."""
    return jax.eval_shape(init, jax.random.key(0))


def checkpointer(directory, mode):
    if mode not in ("incremental", "whole"):
        raise ValueError(f"mode must be 'incremental' or 'whole', got {mode!r}")
    return jax_cb_ckpt.Checkpointer(
        directory, every=EVERY, max_to_keep=3, incremental=mode == "incremental"
    )


def run(directory, mode):
    """Train (or resume) to the end: (the final state, ckpt.stats, the training's
    seconds: the jitted call, compile included, until every save is on disk)."""
    with checkpointer(directory, mode) as ckpt:
        state, start = ckpt.restore_or_init(jax.jit(init), jax.random.key(0))
        began = time.perf_counter()
        state = jax.block_until_ready(make_train(ckpt)(state, start, NUM_UPDATES))
        ckpt.wait()
        wall = time.perf_counter() - began
    return state, ckpt.stats, wall


def digest(state):
    """SHA-256 of every leaf's bytes (a typed key's data), in the tree's order."""
    sha = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        sha.update(str((leaf.shape, leaf.dtype)).encode())
        sha.update(np.ascontiguousarray(np.asarray(leaf)))
    return sha.hexdigest()


def report(state, stats, wall):
    records = [
        {"step": r.step, "nbytes": r.nbytes, "write_s": r.write_s, "written": r.written_bytes}
        for r in stats.recent
    ]
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    return {"recent": records, "nbytes": nbytes, "wall_s": wall, "digest": digest(state)}


if __name__ == "__main__":
    DIRECTORY[0] = sys.argv[1]
    if len(sys.argv) > 3:
        KILL[:] = [int(sys.argv[3]), float(sys.argv[4])]
    print(json.dumps(report(*run(sys.argv[1], sys.argv[2]))), flush=True)
    print("done", flush=True)
