"""PPO on gymnax CartPole-v1: the whole training inside one jit, checkpointed from inside.

    python examples/ppo_cartpole.py                  # train; rerun to resume
    python examples/ppo_cartpole.py --seeds 4        # vmapped over 4 seeds
    python examples/ppo_cartpole.py --kill-demo      # SIGKILL part-way, resume, compare
    python examples/ppo_cartpole.py --progress       # with a progress bar (tqdm)

Each configuration has its own default directory, named by every option that changes the
saved state's shape (`runs/ppo_cartpole-seeds1-t500000`, `...-seeds4-t500000`), so the
commands above run in any order, and a rerun resumes; `--dir` chooses another.

Everything a run needs to continue is in the saved state: the flax TrainState (parameters,
Adam moments and the step count that drives the learning-rate schedule), the environment
states and observations of every parallel environment, the PRNG key, and the learning
curve so far. `ckpt.run` restores the latest checkpoint and runs only the remaining
updates, so a killed or preempted run finishes exactly as if nothing had happened.
SIGTERM is handled: the run saves, stops, and exits with 143; start it again to resume.

Needs the examples extra: pip install -e ".[examples]" (flax, optax, tqdm, gymnax;
gymnax 1.0.1 requires jax<0.12).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time

import flax.linen as nn
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from gymnax.wrappers.purerl import LogWrapper

import jax_cb_ckpt


@dataclasses.dataclass(frozen=True)
class Config:
    total_timesteps: int = 500_000
    num_envs: int = 4
    num_steps: int = 128  # environment steps per env per update
    update_epochs: int = 4
    num_minibatches: int = 4
    lr: float = 2.5e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_eps: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // (self.num_envs * self.num_steps)

    @property
    def minibatch_size(self) -> int:
        return self.num_envs * self.num_steps // self.num_minibatches


class ActorCritic(nn.Module):
    num_actions: int

    @nn.compact
    def __call__(self, obs):
        def dense(features, scale):
            return nn.Dense(
                features,
                kernel_init=nn.initializers.orthogonal(scale),
                bias_init=nn.initializers.zeros,
            )

        h = nn.tanh(dense(64, np.sqrt(2))(obs))
        h = nn.tanh(dense(64, np.sqrt(2))(h))
        logits = dense(self.num_actions, 0.01)(h)
        v = nn.tanh(dense(64, np.sqrt(2))(obs))
        v = nn.tanh(dense(64, np.sqrt(2))(v))
        return logits, jnp.squeeze(dense(1, 1.0)(v), -1)


def make(config: Config):
    """(init, update): `update(state, i)` is one PPO update (rollout + optimisation)."""
    env, env_params = gymnax.make("CartPole-v1")
    env = LogWrapper(env)
    net = ActorCritic(env.action_space(env_params).n)

    def schedule(count):
        # Linear decay over all optimiser steps; `count` lives in the saved Adam state.
        per_update = config.update_epochs * config.num_minibatches
        return config.lr * (1.0 - (count // per_update) / config.num_updates)

    # One optimizer object for every seed: it is static pytree data of the TrainState,
    # so states of different seeds share a tree structure (and can be stacked).
    tx = optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm), optax.adam(schedule, eps=1e-5)
    )

    def init(seed):
        key = jax.random.key(seed)
        key, k_net, k_env = jax.random.split(key, 3)
        obs_shape = env.observation_space(env_params).shape
        params = net.init(k_net, jnp.zeros(obs_shape))
        train = TrainState.create(apply_fn=net.apply, params=params, tx=tx)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(k_env, config.num_envs), env_params
        )
        returns = jnp.full((config.num_updates,), jnp.nan, jnp.float32)
        return {"train": train, "env_state": env_state, "obs": obs, "key": key, "returns": returns}

    def policy(params, obs):
        logits, value = net.apply(params, obs)
        return jax.nn.log_softmax(logits), value

    def rollout(state):
        def env_step(carry, _):
            train, env_state, obs, key = carry
            key, k_act, k_env = jax.random.split(key, 3)
            logp_all, value = policy(train.params, obs)
            action = jax.random.categorical(k_act, logp_all)
            logp = jnp.take_along_axis(logp_all, action[:, None], axis=1)[:, 0]
            obs2, env_state, reward, done, _, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(k_env, config.num_envs), env_state, action, env_params
            )
            step = dict(obs=obs, action=action, logp=logp, value=value, reward=reward, done=done)
            step["ret"] = info["returned_episode_returns"]
            step["finished"] = info["returned_episode"]
            return (train, env_state, obs2, key), step

        carry = (state["train"], state["env_state"], state["obs"], state["key"])
        (_, env_state, obs, key), traj = jax.lax.scan(env_step, carry, None, config.num_steps)
        return env_state, obs, key, traj

    def advantages(traj, last_value):
        def back(carry, t):
            gae, next_value = carry
            not_done = 1.0 - t["done"]
            delta = t["reward"] + config.gamma * next_value * not_done - t["value"]
            gae = delta + config.gamma * config.gae_lambda * not_done * gae
            return (gae, t["value"]), gae

        _, adv = jax.lax.scan(back, (jnp.zeros_like(last_value), last_value), traj, reverse=True)
        return adv, adv + traj["value"]

    def loss_fn(params, batch):
        logp_all, value = policy(params, batch["obs"])
        logp = jnp.take_along_axis(logp_all, batch["action"][:, None], axis=1)[:, 0]
        value_clipped = batch["value"] + jnp.clip(
            value - batch["value"], -config.clip_eps, config.clip_eps
        )
        value_loss = (
            0.5
            * jnp.maximum(
                (value - batch["target"]) ** 2, (value_clipped - batch["target"]) ** 2
            ).mean()
        )
        ratio = jnp.exp(logp - batch["logp"])
        adv = (batch["adv"] - batch["adv"].mean()) / (batch["adv"].std() + 1e-8)
        policy_loss = -jnp.minimum(
            ratio * adv, jnp.clip(ratio, 1 - config.clip_eps, 1 + config.clip_eps) * adv
        ).mean()
        entropy = -(jnp.exp(logp_all) * logp_all).sum(-1).mean()
        return policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy

    def update(state, i):
        env_state, obs, key, traj = rollout(state)
        train = state["train"]
        _, last_value = policy(train.params, obs)
        adv, target = advantages(traj, last_value)
        data = {k: traj[k] for k in ("obs", "action", "logp", "value")}
        data.update(adv=adv, target=target)
        flat = jax.tree_util.tree_map(lambda x: x.reshape((-1, *x.shape[2:])), data)

        def epoch(carry, _):
            train, key = carry
            key, k_perm = jax.random.split(key)
            perm = jax.random.permutation(k_perm, config.num_envs * config.num_steps)
            batches = jax.tree_util.tree_map(
                lambda x: x[perm].reshape((config.num_minibatches, -1, *x.shape[1:])), flat
            )

            def minibatch(train, batch):
                grads = jax.grad(loss_fn)(train.params, batch)
                return train.apply_gradients(grads=grads), None

            train, _ = jax.lax.scan(minibatch, train, batches)
            return (train, key), None

        (train, key), _ = jax.lax.scan(epoch, (train, key), None, config.update_epochs)
        # Mean return of the episodes that ended during this update (NaN if none did).
        finished = traj["finished"].sum()
        mean_return = jnp.where(
            finished > 0, (traj["ret"] * traj["finished"]).sum() / jnp.maximum(finished, 1), jnp.nan
        )
        returns = state["returns"].at[i].set(mean_return)
        return {"train": train, "env_state": env_state, "obs": obs, "key": key, "returns": returns}

    return init, update


def initial_state(config: Config, seeds: int, init=None):
    if init is None:
        init, _ = make(config)
    if seeds == 1:
        return init(0)
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *[init(s) for s in range(seeds)])


def train(
    config: Config, directory: str, *, seeds: int = 1, every: int = 50, progress: bool = False
):
    """Train (or resume) to the end; returns the final state. Blocks until saved.
    `progress`: show a progress bar (tqdm) with updates/s and the last saved update."""
    init, update = make(config)
    state = initial_state(config, seeds, init)
    with jax_cb_ckpt.Checkpointer(directory, every=every, max_to_keep=3) as ckpt:
        return ckpt.run(update, state, config.num_updates, batched=seeds > 1, progress=progress)


def default_directory(config: Config, seeds: int) -> str:
    """One directory per configuration: named by every option that changes the saved
    state's shape (the seed axis, and `returns`' length through the total timesteps),
    so a run never resumes from a checkpoint of another shape."""
    return f"runs/ppo_cartpole-seeds{seeds}-t{config.total_timesteps}"


def final_return(state, last: int = 20) -> np.ndarray:
    """Mean return of the episodes that ended in the last `last` updates, per seed."""
    returns = np.asarray(state["returns"]).reshape(-1, np.shape(state["returns"])[-1])
    tail = returns[:, -last:]
    return np.array([np.nanmean(r) if np.isfinite(r).any() else np.nan for r in tail])


def kill_demo(config: Config, args) -> int:
    """Train in a child process, SIGKILL it part-way, resume here, compare."""
    root = tempfile.mkdtemp(prefix="ppo_cartpole_")
    directory = os.path.join(root, "killed")
    command = [sys.executable, os.path.abspath(__file__), "--dir", directory]
    command += ["--total-timesteps", str(config.total_timesteps), "--seeds", str(args.seeds)]
    command += ["--every", str(args.every)]
    kill_at = config.num_updates // 3 // args.every * args.every or args.every
    print(f"[1] training in a child process; SIGKILL once update {kill_at} is on disk")
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    while child.poll() is None and (jax_cb_ckpt.latest_step(directory) or 0) < kill_at:
        time.sleep(0.005)
    killed = child.poll() is None
    child.send_signal(signal.SIGKILL)
    child.wait()
    print(
        f"    {'killed' if killed else 'finished before the kill'}; checkpoints on disk: "
        f"{jax_cb_ckpt.all_steps(directory)}"
    )
    print("[2] resuming from the latest checkpoint")
    start = time.perf_counter()
    resumed = train(config, directory, seeds=args.seeds, every=args.every, progress=args.progress)
    print(f"    finished in {time.perf_counter() - start:.1f} s")
    print("[3] the same training without interruption")
    start = time.perf_counter()
    reference = train(
        config,
        os.path.join(root, "reference"),
        seeds=args.seeds,
        every=args.every,
        progress=args.progress,
    )
    print(f"    finished in {time.perf_counter() - start:.1f} s")
    same = jax_cb_ckpt.same_bits(resumed, reference)
    print(
        f"final mean return (last 20 updates): resumed {final_return(resumed)}, "
        f"uninterrupted {final_return(reference)}"
    )
    print(f"resumed final state == uninterrupted final state, bit for bit: {same}")
    return 0 if same and killed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--dir",
        help="checkpoint directory (default: runs/ppo_cartpole-seeds<S>-t<T>, one per "
        "configuration)",
    )
    parser.add_argument("--total-timesteps", type=int, default=Config.total_timesteps)
    parser.add_argument("--seeds", type=int, default=1, help=">1: vmapped over seeds")
    parser.add_argument("--every", type=int, default=50, help="checkpoint every N updates")
    parser.add_argument("--kill-demo", action="store_true")
    parser.add_argument("--progress", action="store_true", help="show a progress bar (tqdm)")
    args = parser.parse_args(argv)
    config = Config(total_timesteps=args.total_timesteps)
    if args.kill_demo:
        return kill_demo(config, args)
    if args.dir is None:
        args.dir = default_directory(config, args.seeds)
    start = time.perf_counter()
    latest = jax_cb_ckpt.latest_step(args.dir)
    if latest == config.num_updates:
        print(
            f"resumed at the end: {args.dir} holds a finished run ({latest} updates); "
            "nothing left to train, showing its results (use another --dir to train anew)"
        )
    elif latest is not None:
        print(f"resuming from update {latest} of {config.num_updates} ({args.dir})")
    state = train(config, args.dir, seeds=args.seeds, every=args.every, progress=args.progress)
    returns = np.asarray(state["returns"]).reshape(args.seeds, -1)
    window = max(config.num_updates // 10, 1)
    for u in range(0, config.num_updates, window):
        chunk = returns[:, u : u + window]  # NaN: no episode ended in that update
        mean = np.nanmean(chunk) if np.isfinite(chunk).any() else float("nan")
        print(f"updates {u:4d}-{u + chunk.shape[1] - 1:4d}: mean episode return {mean:6.1f}")
    print(f"final mean return (last 20 updates) per seed: {final_return(state)}")
    print(
        f"{config.num_updates} updates, {config.total_timesteps * args.seeds} env steps "
        f"in {time.perf_counter() - start:.1f} s (checkpoints in {args.dir})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
