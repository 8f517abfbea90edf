"""Reinforcement learning: one agent, several observers, gymnasium's CartPole.

Rank 0 is the agent: it holds the policy.  Ranks 1.. are observers: each has its
own CartPole environment (created on it with ``rpc.remote``) and asks the agent
for an action at every step (``Agent.select_action`` by RPC, with an RRef to the
agent).  Each round, the agent has every observer play one episode at once
(``rpc_async`` on the observers' RRefs), then updates the policy with REINFORCE
on all their episodes.  An episode is an ``async def``: it runs on its observer's
event loop and awaits each action, so no observer thread is held while the agent
thinks.  The reward is the number of steps the pole stayed up
(at most 500).

    python -m torchwire.examples.rl                 # 2 observers
    torchrun --nproc-per-node 3 -m torchwire.examples.rl
"""

from __future__ import annotations

import sys
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchwire.rpc as rpc
from torchwire.examples import _common


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 128)
        self.fc2 = nn.Linear(128, 2)

    def forward(self, x):
        return F.softmax(self.fc2(F.relu(self.fc1(x))), dim=-1)


class Observer:
    """An environment on an observer worker; plays episodes with the agent's actions."""

    def __init__(self, index: int, seed: int, rounds: int, args) -> None:
        import gymnasium as gym
        self.index = index
        self.env = gym.make("CartPole-v1")
        self.seed = seed
        self.episodes = 0
        self.bar = _common.Progress(args, f"observer{index}", index - 1, rounds, "env steps")

    async def run_episode(self, agent_rref) -> list[float]:
        """One episode; returns its rewards (one per step)."""
        state, _ = self.env.reset(seed=self.seed * 10_000 + self.index * 1000 + self.episodes)
        self.episodes += 1
        rewards: list[float] = []
        while True:
            action = await rpc.rpc_async(agent_rref.owner(), Agent.select_action,
                                         args=(agent_rref, self.index,
                                               torch.from_numpy(state)))
            state, reward, terminated, truncated, _ = self.env.step(action)
            rewards.append(float(reward))
            if terminated or truncated:
                break
        self.bar.update(len(rewards), reward=sum(rewards))
        return rewards

    def close(self) -> None:
        self.bar.close()
        self.env.close()


class Agent:
    """The policy, its optimizer, and the log-probabilities of the episodes in play."""

    def __init__(self, observers: list[str], args) -> None:
        self.policy = Policy()
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=args.lr)
        self.gamma = args.gamma
        self.lock = threading.Lock()
        self.rref = rpc.RRef(self)
        self.observers = {i: rpc.remote(name, Observer,
                                        args=(i, args.seed, args.steps, args))
                          for i, name in enumerate(observers, 1)}
        # one generator per observer: actions do not depend on how RPCs interleave
        self.gens = {i: torch.Generator().manual_seed(args.seed * 100 + i)
                     for i in self.observers}
        self.log_probs: dict[int, list] = {i: [] for i in self.observers}

    @staticmethod
    def select_action(agent_rref, index: int, state: torch.Tensor) -> int:
        self = agent_rref.local_value()
        probs = self.policy(state)
        action = int(torch.multinomial(probs.detach(), 1, generator=self.gens[index]))
        self.log_probs[index].append(torch.log(probs[action]))
        return action

    def play_round(self) -> tuple[list[float], float]:
        """Every observer plays one episode; one REINFORCE update on them all.

        Returns:
            (each observer's total reward, the loss of the update)
        """
        futs = {i: ob.rpc_async(timeout=0).run_episode(self.rref)
                for i, ob in self.observers.items()}
        rewards = {i: f.wait() for i, f in futs.items()}
        losses = []
        for i, rs in rewards.items():
            returns, r = [], 0.0
            for reward in reversed(rs):
                r = reward + self.gamma * r
                returns.insert(0, r)
            ret = torch.tensor(returns)
            ret = (ret - ret.mean()) / (ret.std() + 1e-6) if len(ret) > 1 else ret * 0
            losses.append(-(torch.stack(self.log_probs[i]) * ret).sum())
            self.log_probs[i] = []
        loss = torch.stack(losses).sum() / len(losses)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return [sum(rs) for rs in rewards.values()], loss.item()

    def close(self) -> None:
        for ob in self.observers.values():
            ob.rpc_sync().close()


def drive(job: _common.Job) -> None:
    """On rank 0, the agent: runs the job, then prints the summary and saves the plot."""
    args = job.args
    n = job.world_size - 1
    agent = Agent([f"observer{i}" for i in range(1, n + 1)], args)
    t0 = time.perf_counter()
    rounds, env_steps = [], 0
    for _ in range(args.steps):
        rewards, _loss = agent.play_round()
        rounds.append(rewards)
        env_steps += int(sum(rewards))
    elapsed = time.perf_counter() - t0
    agent.close()
    means = [sum(r) / n for r in rounds]
    k, first, last = _common.first_last([means], most=10)
    _common.plot(args, f"REINFORCE on CartPole: 1 agent, {n} observers",
                 {f"observer{i}": (range(1, len(rounds) + 1), [r[i - 1] for r in rounds])
                  for i in range(1, n + 1)} |
                 {"mean, smoothed": (range(1, len(rounds) + 1), _common.smooth(means))},
                 "round (one episode per observer)", "episode reward (steps balanced)")
    _common.summary(args, f"{n} observers, {args.steps} rounds", [
        ("reward", f"{first:.1f} -> {last:.1f} (mean episode reward of the first and last "
                   f"{k} rounds; 500 is the most)"),
        ("best round", f"{max(means):.1f}"),
        ("throughput", f"{env_steps / elapsed:,.0f} environment steps/s, one RPC each"),
    ], elapsed, job.world_size,
        {"first_reward": first, "last_reward": last, "best_reward": max(means)})


def worker(job: _common.Job) -> None:
    _common.drive_or_serve(job, drive, "agent", "observer")


def main(argv=None) -> int:
    p = _common.parser("rl", __doc__, world_size=3, steps=150, lr=0.01)
    p.add_argument("--gamma", type=float, default=0.99, help="discount (default 0.99)")
    return _common.launch(worker, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
