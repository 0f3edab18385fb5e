"""Data-parallel replicas of the embedded engine behind one server (SGLang's --dp-size).

Each replica is a `Scheduler` driving its own `ModelRunner` on its own devices (`placement.py`), on its own
thread; the device calls of different replicas run at the same time. `ReplicatedScheduler` has the
`Scheduler`'s thread-safe surface, so the HTTP server cannot tell one replica from several:

- a request goes to one replica, chosen by `PrefixRouter`: the replica that served the longest prefix of its
  prompt (the next turn of an episode, a sibling sample of a GRPO group), unless that replica has much more
  outstanding work than the least loaded one; otherwise the least loaded one. Like sgl-router's cache-aware
  policy, this keeps each conversation's K/V in one replica's prefix cache.
- aborts and control calls (pause, flush, weight updates, memory) go to every replica; their answers are merged
  (a flush succeeds when every replica flushed, an update when every replica loaded).
No JAX here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from jaxrl_vlm.engine.inbox import ControlMsg, FlushMsg, LoadsMsg, MemoryMsg, PauseMsg, ContinueMsg, UpdateWeightsMsg
from jaxrl_vlm.engine.protocol import GenerateOutput, GenerateRequest
from jaxrl_vlm.engine.scheduler import EngineStats, Scheduler
from rollout.sglang_wire import update_weights_answer

ROUTE_BLOCK_TOKENS = 64  # prompts are matched in blocks of this many tokens
ROUTE_MEMORY_BLOCKS = 200_000  # block digests remembered (LRU), over all replicas
ROUTE_IMBALANCE = 8  # a cache hit is given up when its replica has this many more outstanding requests


def block_digests(input_ids: Sequence[int], block: int = ROUTE_BLOCK_TOKENS) -> list[bytes]:
    """Chained digests of the prompt's whole blocks: digest i identifies tokens [0, (i + 1) x block)."""
    out: list[bytes] = []
    h = b""
    ids = [int(t) for t in input_ids]
    for start in range(0, len(ids) - block + 1, block):
        h = hashlib.blake2b(h + repr(ids[start:start + block]).encode(), digest_size=16).digest()
        out.append(h)
    return out


class PrefixRouter:
    """Chooses a replica per request: longest remembered prompt prefix, else least outstanding requests.

    Image pads are the same token for every image, so two prompts with different pictures of one size share
    block digests: the router may then pick a replica whose cache cannot serve the prefix. That costs a prefill,
    never correctness (each replica's prefix cache checks image digests itself).
    """

    def __init__(self, replicas: int, *, block: int = ROUTE_BLOCK_TOKENS, memory: int = ROUTE_MEMORY_BLOCKS,
                 imbalance: int = ROUTE_IMBALANCE):
        self.outstanding = [0] * replicas
        self.block = block
        self.memory = memory
        self.imbalance = imbalance
        self._owner: OrderedDict[bytes, int] = OrderedDict()  # block digest -> replica that last served it
        self._lock = threading.Lock()

    def pick(self, input_ids: Sequence[int]) -> int:
        """The replica for a prompt; counts it as outstanding until `done`."""
        digests = block_digests(input_ids, self.block)
        with self._lock:
            least = min(range(len(self.outstanding)), key=lambda r: (self.outstanding[r], r))
            choice = least
            for d in reversed(digests):
                owner = self._owner.get(d)
                if owner is not None:
                    if self.outstanding[owner] - self.outstanding[least] < self.imbalance:
                        choice = owner
                    break
            for d in digests:
                self._owner[d] = choice
                self._owner.move_to_end(d)
            while len(self._owner) > self.memory:
                self._owner.popitem(last=False)
            self.outstanding[choice] += 1
            return choice

    def done(self, replica: int) -> None:
        with self._lock:
            self.outstanding[replica] -= 1


class _Gather:
    """Collects one answer per replica and replies once with their merge."""

    def __init__(self, n: int, merge: Callable[[list[Any]], Any], reply: Callable[[Any], None]):
        self.answers: list[Any] = [None] * n
        self.left = n
        self.merge = merge
        self.reply = reply
        self.lock = threading.Lock()

    def part(self, i: int) -> Callable[[Any], None]:
        def deliver(value: Any) -> None:
            with self.lock:
                self.answers[i] = value
                self.left -= 1
                done = self.left == 0
            if done:
                self.reply(self.merge(self.answers))

        return deliver


def _merge_updates(answers: list[dict[str, Any]]) -> dict[str, Any]:
    failed = [f"replica {i}: {a['message']}" for i, a in enumerate(answers) if not a["success"]]
    paused = sum(int(a.get("num_paused_requests", 0)) for a in answers)
    if failed:
        return update_weights_answer(False, "; ".join(failed), paused)
    return update_weights_answer(True, answers[0]["message"], paused)


def _merge_loads(answers: list[dict[str, Any]]) -> dict[str, Any]:
    merged = dict(answers[0])
    for key, value in answers[0].items():
        if isinstance(value, int) and not isinstance(value, bool):
            merged[key] = sum(int(a[key]) for a in answers)
    return merged


def _first_problem(answers: list[str | None]) -> str | None:
    problems = [f"replica {i}: {a}" for i, a in enumerate(answers) if a]
    return "; ".join(problems) or None


_MERGES: dict[type, Callable[[list[Any]], Any]] = {
    PauseMsg: lambda answers: answers[0],
    ContinueMsg: lambda answers: answers[0],
    FlushMsg: all,
    LoadsMsg: _merge_loads,
    UpdateWeightsMsg: _merge_updates,
    MemoryMsg: _first_problem,
}


class ReplicatedScheduler:
    """Several `Scheduler`s behind the surface of one (see the module docstring)."""

    def __init__(self, schedulers: Sequence[Scheduler], router: PrefixRouter | None = None):
        if len(schedulers) < 2:
            raise ValueError("ReplicatedScheduler needs at least two replicas")
        self.replicas = list(schedulers)
        self.router = router or PrefixRouter(len(self.replicas))

    def start(self) -> None:
        for s in self.replicas:
            s.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        for s in self.replicas:
            s.stop(timeout_s)

    @property
    def alive(self) -> bool:
        return all(s.alive for s in self.replicas)

    @property
    def error(self) -> BaseException | None:
        return next((s.error for s in self.replicas if s.error is not None), None)

    @property
    def last_progress(self) -> float:
        return max(s.last_progress for s in self.replicas)

    @property
    def weight_version(self) -> str:
        """The replicas' common version; if they disagree (a partly failed update), a label no trainer version
        equals, so weight-version checks (`/model_info`) fail loudly."""
        versions = [s.weight_version for s in self.replicas]
        return versions[0] if len(set(versions)) == 1 else "mixed:" + ",".join(versions)

    @property
    def stats(self) -> EngineStats:
        """The replicas' counters added up (max_decode_rows: the largest)."""
        merged = EngineStats()
        for field in dataclasses.fields(EngineStats):
            values = [getattr(s.stats, field.name) for s in self.replicas]
            setattr(merged, field.name, max(values) if field.name.startswith("max_") else sum(values))
        return merged

    def submit(self, request: GenerateRequest, on_finish: Callable[[GenerateOutput], None]) -> None:
        replica = self.router.pick(request.prompt.input_ids)

        def finished(output: GenerateOutput) -> None:
            self.router.done(replica)
            on_finish(output)

        self.replicas[replica].submit(request, finished)

    def abort(self, rid: str | None, message: str = "Abort by /abort_request") -> None:
        for s in self.replicas:
            s.abort(rid, message)

    def call(self, msg: ControlMsg) -> None:
        gather = _Gather(len(self.replicas), _MERGES[type(msg)], msg.reply)
        for i, s in enumerate(self.replicas):
            s.call(dataclasses.replace(msg, reply=gather.part(i)))
