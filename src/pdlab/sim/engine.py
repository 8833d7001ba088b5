"""The event engine (SimPy): instances stepping their schedulers, the router, and KV transfers.

One SimPy process per instance, one timeout per scheduler step (not per token), which is what makes 10,000
requests take well under two seconds. Every running sequence gets one token per step, so a request's token
times are a contiguous run of its decode instance's step-end times, recorded as (instance, first step) and
expanded at the end.

Modelled like vLLM's scheduler: decodes are scheduled first, prefill chunks (FCFS) fill what is left of the
token budget; a request is admitted when its whole prompt fits in the free KV cache, and then each step's tokens
take their KV slots as they come (so admitted prompts and growing sequences can still run out of room). When the
running sequences' next tokens do not fit, the latest admitted request is preempted: its KV is dropped and it
waits at the head of the queue to compute its prompt and the tokens it had produced again (vLLM's recompute; a
preempted request's tokens are runs of steps, kept in `SimRequest.segments`). A disaggregated request waits in
its decode instance's queue with that instance's own prompts before it gets KV space for its prompt and posts its
read; the router's threshold and replica choice are pdlab.router's own code. With `threshold_basis: uncached` the
router, as the real one does, picks the decode replica first and counts only the prompt's tokens past the leading
blocks it expects that replica to hold (the blocks of the requests the replica finished, an LRU of
`RouterSpec.prefix_cache_blocks`).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import simpy

from pdlab.config.router import RouterSettings, RouterSpec
from pdlab.router.strategies import (
    PrefixCacheModel,
    ReplicaState,
    RequestFeatures,
    RoutingStrategy,
    decide,
    make_strategy,
)
from pdlab.sim.costs import ServingOverheads, StepCost, TransferCost, chunk_attention
from pdlab.sim.workload import Arrival


@dataclass(eq=False, slots=True)
class SimRequest:
    """A request's life in the simulator; times in seconds."""

    id: int
    arrival: Arrival
    features: RequestFeatures
    path: str = "direct"
    reason: str = ""
    """Why the router took `path` (`over_threshold`, `under_threshold`, `cached_prefix`: pdlab.router's reasons);
    empty without a prefill pool."""
    decode_target: Instance | None = None
    """A disaggregated request's decode instance, when the router chose it before the prefill (`uncached` basis)."""
    computed: int = 0
    """Tokens of the current prefill already computed."""
    cached: int = 0
    """Of those, tokens the instance's prefix cache held when the prefill started (not computed again)."""
    prefill_len: int = 0
    """Tokens the current prefill computes: the prompt, plus the tokens produced before a preemption."""
    produced: int = 0
    """Output tokens produced before the latest preemption (in `segments`)."""
    held: int = 0
    """KV tokens held on the instance computing or sending its prefill (in whole blocks there)."""
    read_held: int = 0
    """KV tokens its decode instance set aside for the read, until the transfer ends (then they are `held`)."""
    blocks: int = 0
    """KV blocks it holds while decoding."""
    grows_at: int = -1
    """While decoding: the step of its instance that needs its next block."""
    remote_kv: bool = False
    """Waiting in a decode instance's queue to read its KV from `prefill_host`."""
    decoding: bool = False
    """In a running batch, producing a token each step."""
    preemptions: int = 0
    segments: list | None = None
    """Runs of tokens cut short by preemptions: (instance, first step, tokens)."""
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
    token_instance: Instance | None = None
    first_step: int = -1
    """Index of the step (on `token_instance`) that produced the run's first token; its token i came at step
    first_step+i (the request's token `produced`+i)."""
    finish: float = math.nan
    failed: str | None = None
    """Why the request could not be served (e.g. longer than an instance's whole KV cache)."""

    @property
    def tokens_left(self) -> int:
        """Output tokens its current run produces: all of them, less those produced before a preemption."""
        return self.arrival.output_tokens - self.produced


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
    """KV blocks held by prefills and reads (`SimRequest.held`, `read_held`, rounded up to blocks)."""
    decode_blocks: int = 0
    """KV blocks of the decoding sequences, as the next step needs them."""
    grow_at: dict = field(default_factory=dict)
    """Step -> decoding requests that need one more block from that step on (every `block_size` tokens)."""
    admitted: dict = field(default_factory=dict)
    """Requests in the running batch (prefilling or decoding), in the order they joined it: vLLM preempts the
    latest first."""
    preemptions: int = 0
    """Requests preempted here (vLLM's `vllm:num_preemptions`)."""
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
    """Fired when the step being computed ends, for whoever waits on it; made on demand."""
    prefix_cache: OrderedDict | None = None
    """With prefix caching: block hashes whose KV the instance holds, least recently used first (at most
    `kv_capacity` tokens' worth; vLLM keeps freed blocks until it needs their space)."""
    block_size: int = 16
    busy_since: float = 0.0
    """When its current stretch of back-to-back steps began (the sender's wake-ups run from there)."""
    next_wake_at: float | None = None
    """The next moment this prefill instance, computing, serves the reads waiting on it
    (`ServingOverheads.sender_wake_s`); drawn on demand."""
    sender_wake: simpy.Event | None = None
    """The event for `next_wake_at`, shared by every read waiting on it."""
    _ends: np.ndarray | None = field(default=None, repr=False)

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
    def step_end_array(self) -> np.ndarray:
        """Step end times as a numpy array (built once, after the run)."""
        if self._ends is None or len(self._ends) != len(self.step_ends):
            self._ends = np.asarray(self.step_ends)
        return self._ends

    def state(self) -> ReplicaState:
        return ReplicaState(url=self.name, in_flight=self.in_flight, running=self.running + self.prefilling,
                            waiting=len(self.prefill_queue) - self.prefilling)

    def longest_kv(self, request: SimRequest) -> int:
        """The most KV tokens `request` will hold here: the prompt on a prefill instance, the whole sequence
        elsewhere (vLLM refuses to start with a cache shorter than its longest sequence)."""
        a = request.arrival
        return a.prompt_tokens if self.role == "prefill" else a.prompt_tokens + a.output_tokens

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def free_blocks(self) -> int:
        """KV blocks left once every running sequence has the slot of the token its next step computes."""
        return self.kv_capacity // self.block_size - self.kv_used - self.decode_blocks


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
        self.expected_cache = (PrefixCacheModel(RouterSpec.model_fields["prefix_cache_blocks"].default)
                               if router.threshold_basis == "uncached" and self.prefill_pool else None)
        """`threshold_basis: uncached`: the router's model of each decode instance's prefix cache, kept as
        pdlab.router keeps it (a request's full blocks, once it finished there)."""
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
            self.requests.append(SimRequest(id=i, arrival=a, features=features, prefill_len=a.prompt_tokens))
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
        decode = None
        if self.prefill_pool:
            a, cached = request.arrival, 0
            if self.expected_cache is not None:  # the decode replica first, then what it lacks of the prompt
                decode = self._choose(self.decode_strategy, self.decode_pool, request)
                cached = self.expected_cache.cached_blocks(decode.name, a.prefix_hashes) * decode.block_size
            decision = decide(a.prompt_tokens, cached, self.router.threshold, self.router.threshold_basis)
            request.path, request.reason = decision.path, decision.reason
        if request.path == "disaggregated":
            request.decode_target = decode
            if request.arrival.prompt_tokens + request.arrival.output_tokens > min(
                    inst.kv_capacity for inst in self.decode_pool):
                request.failed = "sequence longer than a decode instance's KV cache"
                return
            target = self._choose(self.prefill_strategy, self.prefill_pool, request)
            request.prefill_instance = target.name
            self.decisions.append((request.id, request.path, target.name, None))
        else:
            target = decode or self._choose(self.decode_strategy, self.decode_pool, request)
            request.decode_instance = target.name
            self.decisions.append((request.id, request.path, None, target.name))
        if target.blocks_for(target.longest_kv(request)) > target.kv_capacity // target.block_size:
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
        prompt starts its prefill, a disaggregated request gets KV space for its prompt and posts its read (taking
        no budget). Each stage needs budget and KV space left, so a prefill that fills the budget holds back
        everything behind it. A running request whose tokens find no KV space preempts the latest admitted ones
        (`_preempt`); a waiting one waits, and in a step that preempted, nothing waiting is scheduled (vLLM)."""
        queue = inst.prefill_queue
        preempted = inst.preemptions
        while inst.free_blocks() < 0 and inst.admitted:  # each decode's next token needs a slot
            self._preempt(inst)
        budget = inst.budget - inst.running
        chunks = []
        started = 0  # requests of the queue's head whose prefill is under way
        while started < len(queue) and budget > 0 and queue[started].held and not queue[started].remote_kv:
            request = queue[started]
            chunk = min(request.prefill_len - request.computed, budget)
            more = inst.blocks_for(request.held + chunk) - inst.blocks_for(request.held)
            while inst.free_blocks() < more and request.held:
                budget += self._preempt(inst)
            if not request.held:
                break  # it was the latest admitted: preempted itself, and the rest of the queue waits behind it
            inst.kv_used += more
            request.held += chunk
            chunks.append((request, chunk))
            budget -= chunk
            started += 1
        if inst.preemptions > preempted:
            budget = 0
        while inst.pending_joins and budget > 0:
            # transferred KV (its blocks taken when the read was posted): decodes from this step on, first token
            # at its end
            request = inst.pending_joins.popleft()
            request.token_instance = inst
            request.first_step = inst.step
            inst.incoming -= 1
            inst.kv_used -= inst.blocks_for(request.held)
            request.held = 0
            self._start_decoding(inst, request, inst.step, request.prefill_len)
            inst.context += request.prefill_len
            budget -= 1
        while started < len(queue) and budget > 0:
            request = queue[started]
            if inst.running + inst.prefilling + inst.incoming >= inst.max_seqs:
                break
            if request.remote_kv:  # disaggregated: KV space for the prompt, then post the read
                if inst.free_blocks() < inst.blocks_for(request.prefill_len):
                    break  # FCFS: the head waits for space, the rest wait behind it
                del queue[started]
                inst.kv_used += inst.blocks_for(request.prefill_len)
                request.read_held = request.prefill_len
                request.remote_kv = False
                inst.incoming += 1
                request.decode_host = inst
                self.env.process(self._transfer(request))
                continue
            if inst.free_blocks() < inst.blocks_for(request.prefill_len):  # vLLM's scheduler_reserve_full_isl
                break
            cached = inst.cached_prefix(request)
            chunk = min(request.prefill_len - cached, budget)
            inst.admitted[request] = None
            inst.kv_used += inst.blocks_for(cached + chunk)
            request.held = cached + chunk
            inst.prefilling += 1
            request.prefill_start = self.now
            request.computed = request.cached = cached
            chunks.append((request, chunk))
            budget -= chunk
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

    @staticmethod
    def _start_decoding(inst: Instance, request: SimRequest, step: int, slots: int) -> None:
        """`request`'s first token of this run came at step `first_step`: it decodes until its last. At `step` its
        sequence needs `slots` KV slots, one more each step after: a new block every `block_size` steps."""
        request.decoding = True
        inst.admitted[request] = None
        inst.running += 1
        inst.finish_at.setdefault(request.first_step + request.tokens_left - 1, []).append(request)
        request.blocks = inst.blocks_for(slots)
        inst.decode_blocks += request.blocks
        request.grows_at = step + ((1 - slots) % inst.block_size or inst.block_size)  # where slots % size is 1
        inst.grow_at.setdefault(request.grows_at, []).append(request)

    @staticmethod
    def _stop_decoding(inst: Instance, request: SimRequest) -> None:
        request.decoding = False
        inst.running -= 1
        inst.decode_blocks -= request.blocks
        request.blocks = 0
        inst.grow_at[request.grows_at].remove(request)

    def _preempt(self, inst: Instance) -> int:
        """Preempt the request that joined `inst`'s running batch last (vLLM's FCFS policy): drop its KV and
        put it back at the head of the waiting queue, to compute its prompt and the tokens it has produced again
        (recompute; with prefix caching, its prompt's blocks still cached are not computed again). Returns the
        token budget it gave back."""
        victim, _ = inst.admitted.popitem()
        inst.preemptions += 1
        victim.preemptions += 1
        freed_budget = 0
        if victim.decoding:
            run = inst.step - victim.first_step  # tokens of this run so far
            inst.finish_at[victim.first_step + victim.tokens_left - 1].remove(victim)
            self._stop_decoding(inst, victim)
            inst.context -= victim.prefill_len + run
            freed_budget = 1
            if run:
                victim.segments = (victim.segments or []) + [(inst, victim.first_step, run)]
            victim.produced += run
            victim.prefill_len += run
            victim.token_instance, victim.first_step = None, -1
            queue = inst.prefill_queue
            head = 0
            while head < len(queue) and queue[head].held:  # prefills under way stay ahead of it
                head += 1
            queue.insert(head, victim)
        else:  # prefilling: the first of the queue's requests not under way from now on
            inst.kv_used -= inst.blocks_for(victim.held)
            victim.held = 0
            inst.prefilling -= 1
        victim.computed = victim.cached = 0
        return freed_budget

    def _end_step(self, inst: Instance, chunks: list) -> None:
        now = self.now
        inst.step_ends.append(now)
        for request in inst.pending_joins:
            if math.isnan(request.transfer_seen):
                request.transfer_seen = now
        inst.context += inst.running  # every decoding sequence grew by one token
        for request, chunk in chunks:
            request.computed += chunk
            if request.computed < request.prefill_len:
                continue
            inst.prefill_queue.popleft()  # completed prefills are always at the head (FCFS chunks)
            inst.prefilling -= 1
            request.prefill_end = now
            inst.keep_prefix(request)
            if inst.role == "prefill":
                del inst.admitted[request]  # its KV waits for the read, outside the running batch
                inst.in_flight -= 1
                self._prefill_done(inst, request)
                continue
            request.token_instance = inst
            request.first_step = inst.step
            if request.tokens_left > 1:  # decodes from the next step on
                inst.kv_used -= inst.blocks_for(request.held)
                request.held = 0
                self._start_decoding(inst, request, inst.step + 1, request.prefill_len + 1)
                inst.context += request.prefill_len + 1
            else:
                self._finish(inst, request, now)
        for request in inst.finish_at.pop(inst.step, ()):
            self._finish(inst, request, now)
        inst.step += 1
        growing = inst.grow_at.pop(inst.step, None)
        if growing:
            inst.decode_blocks += len(growing)
            inst.grow_at.setdefault(inst.step + inst.block_size, []).extend(growing)
            for request in growing:
                request.blocks += 1
                request.grows_at += inst.block_size

    def _finish(self, inst: Instance, request: SimRequest, now: float) -> None:
        if request.decoding:
            self._stop_decoding(inst, request)
            inst.context -= request.prefill_len + request.tokens_left
        inst.kv_used -= inst.blocks_for(request.held)
        request.held = 0
        del inst.admitted[request]
        inst.in_flight -= 1
        request.finish = now
        if self.expected_cache is not None:
            self.expected_cache.add(inst.name, request.arrival.prefix_hashes)

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
        decode = request.decode_target or self._choose(self.decode_strategy, self.decode_pool, request)
        request.decode_instance = decode.name
        self.decisions.append((request.id, request.path, request.prefill_instance, decode.name))
        decode.in_flight += 1
        request.prefill_host = prefill
        request.remote_kv = True
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
        prefill.kv_used -= prefill.blocks_for(request.held)
        request.held, request.read_held = request.read_held, 0
        decode.keep_prefix(request)  # vLLM caches the blocks read too: a later prompt starting the same way hits them
        # Joins at the next step it plans: the connector reports finished reads at the end of a step (vLLM's
        # get_finished), so a read that completes while the decode instance computes waits for that step.
        decode.pending_joins.append(request)
        self._wake(decode)
        self._wake(prefill)  # freed KV may admit a waiting prefill
