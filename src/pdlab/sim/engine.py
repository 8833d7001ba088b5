"""The event engine (SimPy): instances stepping their schedulers, the router, and KV transfers.

One SimPy process per instance, one timeout per scheduler step (not per token), which is what makes 10,000
requests take well under two seconds. Every running sequence gets one token per step, so a request's token
times are a contiguous run of its decode instance's step-end times, recorded as (instance, first step) and
expanded at the end.

Modelled like vLLM's scheduler: decodes are scheduled first, prefill chunks (FCFS) fill what is left of the
token budget; a request is admitted only when its whole sequence (prompt + output) fits in the instance's KV cache
(so nothing is ever preempted); a disaggregated request waits in its decode instance's queue with that instance's
own prompts before it posts its KV read; the router's threshold and replica choice are pdlab.router's own code.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import simpy

from pdlab.config.router import RouterSettings
from pdlab.router.strategies import ReplicaState, RequestFeatures, RoutingStrategy, decide_path, make_strategy
from pdlab.sim.costs import ServingOverheads, StepCost, TransferCost, chunk_attention
from pdlab.sim.workload import Arrival


@dataclass(eq=False, slots=True)
class SimRequest:
    """A request's life in the simulator; times in seconds."""

    id: int
    arrival: Arrival
    features: RequestFeatures
    path: str = "direct"
    computed: int = 0
    """Prompt tokens already prefilled."""
    cached: int = 0
    """Of those, tokens the instance's prefix cache held when the prefill started (not computed again)."""
    reserved: int = 0
    """KV tokens reserved on the instance currently holding it."""
    prefill_instance: str | None = None
    decode_instance: str | None = None
    prefill_start: float = math.nan
    prefill_end: float = math.nan
    transfer_queued: float = math.nan
    """When the decode instance posted the KV read (what NIXL's transfer time counts from)."""
    transfer_start: float = math.nan
    transfer_end: float = math.nan
    transfer_seen: float = math.nan
    """When the decode instance noticed the read had ended: at once if it was idle, else at the end of its step
    under way (the connector polls between steps). What vLLM's transfer time (`nixl_xfer_time`) counts to."""
    prefill_host: Instance | None = None
    decode_host: Instance | None = None
    decode_reserved: int = 0
    token_instance: Instance | None = None
    first_step: int = -1
    """Index of the step (on `token_instance`) that produced the first token; token i came at step first_step+i."""
    finish: float = math.nan
    failed: str | None = None
    """Why the request could not be served (e.g. longer than an instance's whole KV cache)."""


class Link:
    """One prefill instance's outgoing KV link: `concurrency` lanes (a SimPy resource, FIFO)."""

    def __init__(self, cost: TransferCost):
        self.cost = cost
        self.lanes: simpy.Resource | None = None
        """Made when a simulation binds the link to its environment."""


@dataclass(eq=False)
class Instance:
    """One serving instance and its scheduler state."""

    name: str
    role: str
    cost: StepCost
    budget: int
    max_seqs: int
    kv_capacity: int
    link: Link | None = None
    kv_used: int = 0
    in_flight: int = 0
    """Requests the router has in flight here (its ReplicaState view)."""
    prefill_queue: deque = field(default_factory=deque)
    """Requests waiting for or in prefill, FCFS; on a decode instance also disaggregated requests waiting to post
    their KV read (vLLM keeps both in one waiting queue)."""
    pending_joins: deque = field(default_factory=deque)
    """Transferred requests whose KV has arrived, waiting for a token of the step budget to join the batch."""
    running: int = 0
    context: int = 0
    prefilling: int = 0
    """Admitted requests still prefilling (they count against max_seqs)."""
    incoming: int = 0
    """Admitted transferred requests not yet decoding (they count against max_seqs)."""
    finish_at: dict = field(default_factory=dict)
    step: int = 0
    step_ends: list = field(default_factory=list)
    idle: simpy.Event | None = None
    """While the instance has nothing to do: the event that wakes it."""
    busy: bool = False
    """Computing a step."""
    step_done: simpy.Event | None = None
    prefix_cache: OrderedDict | None = None
    """With prefix caching: block hashes whose KV the instance holds, least recently used first (at most
    `kv_capacity` tokens' worth; vLLM keeps freed blocks until it needs their space)."""
    block_size: int = 16

    def cached_prefix(self, request: SimRequest) -> int:
        """Prompt tokens of `request` whose KV this instance holds: its leading blocks found in the prefix cache,
        short of the prompt's last token (which vLLM always computes, for its logits). Touches the blocks hit."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        hits = 0
        for block in request.arrival.prefix_hashes:  # chained hashes: only a leading run can be reused
            if block not in cache:
                break
            cache.move_to_end(block)
            hits += 1
        return min(hits * self.block_size, request.arrival.prompt_tokens - 1)

    def keep_prefix(self, request: SimRequest) -> None:
        """Remember a prefilled prompt's blocks, evicting the least recently used beyond the cache's capacity."""
        cache = self.prefix_cache
        if cache is None:
            return
        for block in request.arrival.prefix_hashes:
            cache[block] = None
            cache.move_to_end(block)
        while len(cache) > max(self.kv_capacity // self.block_size, 1):
            cache.popitem(last=False)
    """Fired when the step being computed ends, for whoever waits on it; made on demand."""
    busy_since: float = 0.0
    """When its current stretch of back-to-back steps began (the sender's wake-ups run from there)."""
    next_wake_at: float | None = None
    """The next moment this prefill instance, computing, serves the reads waiting on it
    (`ServingOverheads.sender_wake_s`); drawn on demand."""
    sender_wake: simpy.Event | None = None
    """The event for `next_wake_at`, shared by every read waiting on it."""
    _ends: np.ndarray | None = field(default=None, repr=False)

    def step_end_array(self) -> np.ndarray:
        """Step end times as a numpy array (built once, after the run)."""
        if self._ends is None or len(self._ends) != len(self.step_ends):
            self._ends = np.asarray(self.step_ends)
        return self._ends

    def state(self) -> ReplicaState:
        return ReplicaState(url=self.name, in_flight=self.in_flight, running=self.running + self.prefilling,
                            waiting=len(self.prefill_queue) - self.prefilling)

    def reserve_for(self, request: SimRequest) -> int:
        """KV tokens to hold: the prompt on a prefill instance, the whole sequence elsewhere."""
        a = request.arrival
        return a.prompt_tokens if self.role == "prefill" else a.prompt_tokens + a.output_tokens


class Simulation:
    """A deployment of instances behind pdlab's routing decisions, driven by a list of arrivals."""

    def __init__(self, *, router: RouterSettings, colocated: Sequence[Instance] = (),
                 prefill: Sequence[Instance] = (), decode: Sequence[Instance] = (), record: bool = False,
                 overheads: ServingOverheads | None = None, seed: int = 0):
        self.router = router
        self.overheads = overheads or ServingOverheads()
        self._step_jitters = self.overheads.step_jitters(seed, pd=bool(prefill))  # a P/D pair strays further
        self._wake_rng = np.random.default_rng((seed, 1))
        self.prefill_pool = list(prefill)
        self.decode_pool = list(colocated) or list(decode)
        self.prefill_strategy: RoutingStrategy = make_strategy(router.prefill_strategy)
        self.decode_strategy: RoutingStrategy = make_strategy(router.decode_strategy)
        self.env = simpy.Environment()
        self.requests: list[SimRequest] = []
        self.decisions: list[tuple[int, str, str | None, str | None]] = []
        """(request id, path, prefill instance, decode instance), in decision order."""
        self.trace: list[tuple[str, RequestFeatures, list[ReplicaState], int]] | None = [] if record else None
        """With `record`: every replica choice as (pool, features, snapshot, chosen index), to replay elsewhere."""

    # -- processes ----------------------------------------------------------------------------------------------
    @property
    def now(self) -> float:
        return self.env.now

    def run(self, arrivals: Sequence[Arrival]) -> list[SimRequest]:
        for i, a in enumerate(arrivals):
            features = RequestFeatures(prompt_tokens=a.prompt_tokens, block_hashes=a.prefix_hashes,
                                       session_key=a.session)
            self.requests.append(SimRequest(id=i, arrival=a, features=features))
        for inst in self.prefill_pool + self.decode_pool:
            if inst.link is not None:
                inst.link.lanes = simpy.Resource(self.env, capacity=inst.link.cost.concurrency)
            self.env.process(self._serve(inst))
        self.env.process(self._clients())
        self.env.run()
        return self.requests

    def _clients(self):
        env = self.env
        delay = self.overheads.request_s  # sent at at_s, seen by the router and the instance this much later
        for request in sorted(self.requests, key=lambda r: r.arrival.at_s):
            if request.arrival.at_s + delay > env.now:
                yield env.timeout(request.arrival.at_s + delay - env.now)
            self._arrive(request)

    def _serve(self, inst: Instance):
        """An instance's scheduler loop: plan a step, spend its duration, apply it; sleep when there is no work."""
        env = self.env
        admission = self.overheads.admission_s.get(inst.role, 0.0)
        rested = True
        while True:
            step = self._plan_step(inst)
            if step is None:
                inst.idle = env.event()
                yield inst.idle
                inst.idle = None
                if admission > 0:  # what arrives while it wakes joins its first step
                    yield env.timeout(admission)
                rested = True
                continue
            chunks, duration = step
            if rested:
                inst.busy_since, rested = env.now, False
            inst.busy = True
            yield env.timeout(max(duration + next(self._step_jitters), 0.0))
            inst.busy = False
            if inst.step_done is not None:
                inst.step_done.succeed()
                inst.step_done = None
            self._end_step(inst, chunks)

    # -- router -------------------------------------------------------------------------------------------------
    def _choose(self, strategy: RoutingStrategy, pool: list[Instance], request: SimRequest) -> Instance:
        states = [inst.state() for inst in pool]
        index = strategy.choose(request.features, states)
        strategy.observe(request.features, states[index])
        if self.trace is not None:
            self.trace.append((pool[0].role, request.features, states, index))
        return pool[index]

    def _arrive(self, request: SimRequest) -> None:
        if self.prefill_pool and decide_path(request.arrival.prompt_tokens, self.router.threshold) == "disaggregated":
            request.path = "disaggregated"
            if request.arrival.prompt_tokens + request.arrival.output_tokens > min(
                    inst.kv_capacity for inst in self.decode_pool):
                request.failed = "sequence longer than a decode instance's KV cache"
                return
            target = self._choose(self.prefill_strategy, self.prefill_pool, request)
            request.prefill_instance = target.name
            self.decisions.append((request.id, request.path, target.name, None))
        else:
            target = self._choose(self.decode_strategy, self.decode_pool, request)
            request.decode_instance = target.name
            self.decisions.append((request.id, request.path, None, target.name))
        if target.reserve_for(request) > target.kv_capacity:
            request.failed = f"sequence longer than {target.name}'s KV cache"
            return
        target.in_flight += 1
        self._reach(target, request)

    def _reach(self, inst: Instance, request: SimRequest) -> None:
        """`request` reaches `inst`'s API server: it joins the waiting queue after the streams `inst` serves now
        have held it up (`ServingOverheads.request_per_stream_s`)."""
        held = self.overheads.request_per_stream_s * inst.running
        if held > 0:
            self.env.process(self._join_after(inst, request, held))
        else:
            inst.prefill_queue.append(request)
            self._wake(inst)

    def _join_after(self, inst: Instance, request: SimRequest, held: float):
        yield self.env.timeout(held)
        inst.prefill_queue.append(request)
        self._wake(inst)

    # -- instances ----------------------------------------------------------------------------------------------
    def _step_end(self, inst: Instance) -> simpy.Event:
        """An event fired when `inst`'s current step ends (call only while it is busy)."""
        if inst.step_done is None:
            inst.step_done = self.env.event()
        return inst.step_done

    @staticmethod
    def _wake(inst: Instance) -> None:
        if inst.idle is not None and not inst.idle.triggered:
            inst.idle.succeed()

    def _plan_step(self, inst: Instance) -> tuple[list, float] | None:
        """What the next step computes and how long it takes; None when there is nothing to do.

        In vLLM's order: running decodes, then prefills already under way (FCFS chunks), then requests whose KV
        has arrived (one token each: the prompt's last token is computed again), then the waiting queue, FCFS: a
        prompt starts its prefill, a disaggregated request gets its KV space and posts its read (taking no budget).
        Each stage needs budget left, so a prefill that fills the budget holds back everything behind it."""
        budget = inst.budget - inst.running
        chunks = []
        queue = inst.prefill_queue
        started = 0  # requests of the queue's head whose prefill is under way
        while started < len(queue) and budget > 0 and queue[started].reserved and queue[started].prefill_host is None:
            request = queue[started]
            chunks.append((request, min(request.arrival.prompt_tokens - request.computed, budget)))
            budget -= chunks[-1][1]
            started += 1
        while inst.pending_joins and budget > 0:  # transferred KV: decodes from this step on, first token at its end
            request = inst.pending_joins.popleft()
            request.token_instance = inst
            request.first_step = inst.step
            inst.incoming -= 1
            inst.running += 1
            inst.context += request.arrival.prompt_tokens
            inst.finish_at.setdefault(inst.step + request.arrival.output_tokens - 1, []).append(request)
            budget -= 1
        while started < len(queue) and budget > 0:
            request = queue[started]
            need = inst.reserve_for(request)
            if inst.kv_used + need > inst.kv_capacity or \
                    inst.running + inst.prefilling + inst.incoming >= inst.max_seqs:
                break  # FCFS: the head waits for space, the rest wait behind it
            inst.kv_used += need
            if request.prefill_host is not None:  # disaggregated: post the KV read
                del queue[started]
                inst.incoming += 1
                request.decode_reserved = need
                request.decode_host = inst
                self.env.process(self._transfer(request))
                continue
            request.reserved = need
            inst.prefilling += 1
            request.prefill_start = self.now
            request.computed = request.cached = inst.cached_prefix(request)
            chunks.append((request, min(request.arrival.prompt_tokens - request.computed, budget)))
            budget -= chunks[-1][1]
            started += 1
        if not chunks and not inst.running:
            return None
        prefill_tokens = sum(chunk for _, chunk in chunks)
        # All pairs, those of chunks that start their prompt, and the chunks' squares (one pass: a hot path).
        attention = fresh = square = 0.0
        for request, chunk in chunks:
            pairs = chunk_attention(chunk, request.computed)
            attention += pairs
            square += chunk * chunk / 2
            if request.computed == 0:
                fresh += pairs
        return chunks, inst.cost.step_time(prefill_tokens, attention, inst.running, inst.context, fresh, square)

    def _end_step(self, inst: Instance, chunks: list) -> None:
        now = self.now
        inst.step_ends.append(now)
        for request in inst.pending_joins:
            if math.isnan(request.transfer_seen):
                request.transfer_seen = now
        inst.context += inst.running  # every decoding sequence grew by one token
        for request, chunk in chunks:
            request.computed += chunk
            if request.computed < request.arrival.prompt_tokens:
                continue
            inst.prefill_queue.popleft()  # completed prefills are always at the head (FCFS chunks)
            inst.prefilling -= 1
            request.prefill_end = now
            inst.keep_prefix(request)
            if inst.role == "prefill":
                inst.in_flight -= 1
                self._prefill_done(inst, request)
            else:
                request.token_instance = inst
                request.first_step = inst.step
                if request.arrival.output_tokens > 1:  # decodes from the next step on
                    inst.running += 1
                    inst.context += request.arrival.prompt_tokens + 1
                    inst.finish_at.setdefault(inst.step + request.arrival.output_tokens - 1, []).append(request)
                else:
                    self._finish(inst, request, now, decoding=False)
        for request in inst.finish_at.pop(inst.step, ()):
            self._finish(inst, request, now, decoding=True)
        inst.step += 1

    def _finish(self, inst: Instance, request: SimRequest, now: float, decoding: bool) -> None:
        if decoding:
            inst.running -= 1
            inst.context -= request.arrival.prompt_tokens + request.arrival.output_tokens
        inst.kv_used -= request.reserved
        request.reserved = 0
        inst.in_flight -= 1
        request.finish = now

    # -- P/D hand-off -------------------------------------------------------------------------------------------
    def _prefill_done(self, prefill: Instance, request: SimRequest) -> None:
        if self.overheads.handoff_s > 0:
            self.env.process(self._handoff(prefill, request))
        else:
            self._hand_to_decode(prefill, request)

    def _handoff(self, prefill: Instance, request: SimRequest):
        """The router's second hop: prefill's answer travels back and the decode request goes out."""
        yield self.env.timeout(self.overheads.handoff_s)
        self._hand_to_decode(prefill, request)

    def _hand_to_decode(self, prefill: Instance, request: SimRequest) -> None:
        decode = self._choose(self.decode_strategy, self.decode_pool, request)
        request.decode_instance = decode.name
        self.decisions.append((request.id, request.path, request.prefill_instance, decode.name))
        decode.in_flight += 1
        request.prefill_host = prefill
        # It waits in the decode instance's queue with its prompts; vLLM's scheduler gives it KV space, and the
        # connector posts its read, between steps (`_plan_step`).
        self._reach(decode, request)

    def _sender_serves(self, prefill: Instance):
        """Wait until a computing `prefill` instance serves the reads waiting on it: when it goes idle, or at the
        next moment its progress thread runs (`_next_wake`; none when `sender_wake_s` is 0), whichever comes first.
        A step that ends with another right behind it serves nothing. Every read waiting on it then completes at
        once: they wait on one shared event."""
        while prefill.busy:
            if self.overheads.sender_wake_s <= 0:
                yield self._step_end(prefill)
                continue
            wake_at = self._next_wake(prefill)
            if prefill.sender_wake is None or prefill.sender_wake.processed:
                prefill.sender_wake = self.env.timeout(wake_at - self.now)
            wake = prefill.sender_wake
            fired = yield self._step_end(prefill) | wake
            if wake in fired:
                return
            # (the step that ended has handed over to the next one by now, if there is one: `_serve` plans it
            # before a waiting read resumes)

    def _next_wake(self, prefill: Instance) -> float:
        """The sender's next wake-up at or after now. Wake-ups form a renewal process over each stretch of
        back-to-back steps, with gaps gamma-distributed of mean `sender_wake_s` and coefficient of variation
        `sender_wake_cv`. It is in equilibrium from the stretch's start (where the progress thread stood in its
        turn when the engine took the core is arbitrary): the first wake-up is a uniform fraction of a
        length-biased gap away (gamma with one more unit of shape), so a read posted at any moment waits as long
        on average, and with exponential gaps (cv 1) the process is exactly Poisson. Drawn lazily, so a stretch
        no read waits on costs nothing."""
        wake_at = prefill.next_wake_at
        if wake_at is None or wake_at < prefill.busy_since:  # a new stretch: start over
            wake_at = prefill.busy_since + float(self._wake_rng.random()) * self._wake_gap(biased=True)
            prefill.sender_wake = None
        while wake_at < self.now:
            wake_at += self._wake_gap()
            prefill.sender_wake = None
        prefill.next_wake_at = wake_at
        return wake_at

    def _wake_gap(self, biased: bool = False) -> float:
        """One gap between wake-ups; `biased`: the gap that covers a given moment (longer ones are likelier)."""
        mean, cv = self.overheads.sender_wake_s, self.overheads.sender_wake_cv
        if cv <= 0:
            return mean
        shape = 1.0 / (cv * cv)
        return float(self._wake_rng.gamma(shape + (1.0 if biased else 0.0), mean / shape))

    def _transfer(self, request: SimRequest):
        """Pull the KV over the prefill instance's link, then hand the request to the decode batch."""
        prefill, decode = request.prefill_host, request.decode_host
        link = prefill.link
        request.transfer_queued = self.now
        if self.overheads.transfer_waits_for_sender:
            # before a lane: reads waiting on the sender do not queue behind each other, they finish together
            yield from self._sender_serves(prefill)
        with link.lanes.request() as lane:
            yield lane
            request.transfer_start = self.now
            yield self.env.timeout(link.cost.transfer_time(request.arrival.prompt_tokens,
                                                           request.prefill_end - request.prefill_start))
        request.transfer_end = self.now
        if not decode.busy:
            request.transfer_seen = self.now
        prefill.kv_used -= request.reserved
        request.reserved = request.decode_reserved
        # Joins at the next step it plans: the connector reports finished reads at the end of a step (vLLM's
        # get_finished), so a read that completes while the decode instance computes waits for that step.
        decode.pending_joins.append(request)
        self._wake(decode)
        self._wake(prefill)  # freed KV may admit a waiting prefill
