"""The event engine on scenarios small enough to work out by hand, plus monotonic sanity checks."""

from __future__ import annotations

import json

import pytest

from pdlab.config.base import ConfigError
from pdlab.config.router import RouterSettings
from pdlab.config.sim import SimSpec
from pdlab.model.catalog import load_catalog
from pdlab.sim.costs import FittedCost, RooflineCost, ServingOverheads, TransferCost, chunk_attention
from pdlab.sim.engine import Instance, Link, Simulation
from pdlab.sim.scenario import prepare, simulate
from pdlab.sim.summary import summarize, token_times
from pdlab.sim.workload import Arrival

# 10 ms per step + 1 ms per prefill token + 1 us per attention pair + 2 ms per decoding sequence + 1 us per
# context token + 0.5 us more per pair of a chunk that starts its prompt: distinct coefficients, so a wrong feature
# shows up as a wrong time.
COST = FittedCost((0.010, 0.001, 1e-6, 0.002, 1e-6, 5e-7))


def first_chunk(tokens: int, decode_seqs: int = 0, decode_context: int = 0) -> float:
    """A step that starts a prompt (all its attention pairs fresh), beside `decode_seqs` decoding sequences."""
    return COST.step_time(tokens, chunk_attention(tokens, 0), decode_seqs, decode_context, chunk_attention(tokens, 0))


def instance(name: str, role: str, *, budget: int = 8192, link: Link | None = None,
             cost: FittedCost = COST) -> Instance:
    return Instance(name=name, role=role, cost=cost, budget=budget, max_seqs=64, kv_capacity=100_000, link=link)


def test_one_disaggregated_request_ttft_is_queue_plus_prefill_plus_transfer_plus_first_decode_step() -> None:
    catalog = load_catalog()
    transfer = TransferCost(catalog.links["tcp-10gbe"], kv_bytes_per_token=1000, num_layers=4)
    prefill = instance("prefill-0", "prefill", link=Link(transfer))
    decode = instance("decode-0", "decode")
    sim = Simulation(router=RouterSettings(threshold=100), prefill=[prefill], decode=[decode])
    [request] = sim.run([Arrival(at_s=1.0, prompt_tokens=500, output_tokens=3, cls="long")])

    prefill_s = first_chunk(500)
    transfer_s = transfer.transfer_time(500)
    first_decode_s = COST.step_time(0, 0, 1, 500)
    assert request.path == "disaggregated"
    assert request.prefill_start == 1.0  # no queue: an idle instance starts at once
    assert request.prefill_end == pytest.approx(1.0 + prefill_s)
    assert request.transfer_end - request.transfer_start == pytest.approx(transfer_s)
    times = token_times(request)
    assert times[0] - 1.0 == pytest.approx(prefill_s + transfer_s + first_decode_s)
    assert times[1] - times[0] == pytest.approx(COST.step_time(0, 0, 1, 501))
    assert len(times) == 3 and request.finish == times[-1]
    assert prefill.kv_used == 0 and decode.kv_used == 0 and decode.running == 0 and decode.context == 0


def test_serving_overheads_delay_the_request_and_the_hand_off_by_exactly_their_amounts() -> None:
    catalog = load_catalog()
    transfer = TransferCost(catalog.links["tcp-10gbe"], kv_bytes_per_token=1000, num_layers=4)
    arrival = Arrival(at_s=1.0, prompt_tokens=500, output_tokens=3, cls="long")

    def first_token(overheads: ServingOverheads | None) -> float:
        sim = Simulation(router=RouterSettings(threshold=100), prefill=[instance("p", "prefill", link=Link(transfer))],
                         decode=[instance("d", "decode")], overheads=overheads)
        [request] = sim.run([arrival])
        return token_times(request)[0]

    plain = first_token(None)
    assert first_token(ServingOverheads(request_s=0.02)) == pytest.approx(plain + 0.02)
    assert first_token(ServingOverheads(request_s=0.02, handoff_s=0.005)) == pytest.approx(plain + 0.025)


@pytest.mark.parametrize(("streams", "first_token_s"), [(1, 0.520), (2, 0.530)])
def test_a_request_reaches_the_queue_later_by_the_streams_its_instance_serves(streams: int, first_token_s: float
                                                                             ) -> None:
    """10 ms steps from 0 on, `streams` sequences decoding, a prompt arriving at 0.501 s with 5 ms per stream: one
    stream holds it to 0.506 (it still joins the step from 0.51, first token at 0.52), two to 0.511 (the step from
    0.52, first token at 0.53). Streams that arrived together pay nothing (none was running yet)."""
    flat = FittedCost((0.010, 0.0, 0.0, 0.0, 0.0, 0.0))
    inst = instance("c", "colocated", cost=flat)
    sim = Simulation(router=RouterSettings(), colocated=[inst], overheads=ServingOverheads(request_per_stream_s=0.005))
    *background, probe = sim.run([Arrival(0.0, 8, 200, "stream")] * streams + [Arrival(0.501, 16, 1, "probe")])
    assert all(token_times(r)[0] == pytest.approx(0.010) for r in background)
    assert token_times(probe)[0] == pytest.approx(first_token_s)


def test_a_kv_read_beside_a_busy_prefill_instance_waits_until_it_goes_idle() -> None:
    """Two prompts back to back on one prefill instance: the first one's read is posted while the second one is
    prefilled in 512-token steps. With `transfer_waits_for_sender` and no wake-ups it starts when the instance goes
    idle (the ends of the steps in between, each followed by the next, serve nothing), then takes its wire time;
    without, it starts at once. A read beside an idle sender starts at once either way."""
    catalog = load_catalog()
    transfer = TransferCost(catalog.links["tcp-10gbe"], kv_bytes_per_token=1000, num_layers=4)
    arrivals = [Arrival(at_s=1.0, prompt_tokens=500, output_tokens=2, cls="long"),
                Arrival(at_s=1.1, prompt_tokens=2000, output_tokens=2, cls="long")]

    def run(waits: bool):  # type: ignore[no-untyped-def]
        prefill = instance("p", "prefill", budget=512, link=Link(transfer))
        sim = Simulation(router=RouterSettings(threshold=100), prefill=[prefill], decode=[instance("d", "decode")],
                         overheads=ServingOverheads(transfer_waits_for_sender=waits))
        return prefill, sim.run(arrivals)

    _, (alone, _) = run(False)
    assert alone.transfer_start == pytest.approx(alone.transfer_queued)
    assert alone.transfer_end - alone.transfer_queued == pytest.approx(transfer.transfer_time(500))
    assert alone.transfer_seen == alone.transfer_end  # the decode instance was idle: noticed at once
    prefill, (gated, second) = run(True)
    assert second.prefill_start == pytest.approx(gated.prefill_end)  # the prefill instance stays busy
    assert gated.transfer_queued == pytest.approx(gated.prefill_end)  # the decode instance was idle: posted at once
    steps_between = [t for t in prefill.step_ends if gated.transfer_queued < t < second.prefill_end]
    assert len(steps_between) == 3  # 2,000 tokens in 512-token steps: three ends before the last
    assert gated.transfer_start == pytest.approx(second.prefill_end)
    assert gated.transfer_end - gated.transfer_start == pytest.approx(transfer.transfer_time(500))
    # the second prompt's read, posted at that instant beside the now idle sender, waits only for the one lane
    assert second.transfer_queued == pytest.approx(second.prefill_end)
    assert second.transfer_start == pytest.approx(gated.transfer_end)


def _tcp_transfer() -> TransferCost:
    return TransferCost(load_catalog().links["tcp-10gbe"], kv_bytes_per_token=1000, num_layers=4)


def _reads_posted_together(wake_s: float, seed: int = 0, cv: float = 1.0) -> tuple[Instance, list]:
    """Three 100-token prompts and a 2,000-token one reach one prefill instance together (budget 512): the first
    step holds the three and the long one's first chunk, so the three reads are posted together at its end, while
    the instance goes on with the long prompt's next chunk."""
    transfer = _tcp_transfer()
    arrivals = [Arrival(at_s=1.0, prompt_tokens=100, output_tokens=2, cls="short")] * 3 + \
        [Arrival(at_s=1.0, prompt_tokens=2000, output_tokens=2, cls="long")]
    prefill = instance("p", "prefill", budget=512, link=Link(transfer))
    sim = Simulation(router=RouterSettings(threshold=50), prefill=[prefill], decode=[instance("d", "decode")],
                     overheads=ServingOverheads(transfer_waits_for_sender=True, sender_wake_s=wake_s,
                                                sender_wake_cv=cv), seed=seed)
    return prefill, sim.run(arrivals)[:3]


def test_reads_waiting_on_a_busy_sender_complete_together_when_it_serves_them() -> None:
    """Posted together while the sender computes, the three reads are served at one moment, before the step under
    way ends when the sender's wake-ups are frequent (mean a thousandth of a step), and their bytes then move one
    after another over the link's one lane. With rare wake-ups the sender going idle serves them."""
    wire = _tcp_transfer().transfer_time(100)
    # (a 2,000-token read takes about 20 times a 100-token one)
    for wake_s, served_before_step_end in ((1e-5, True), (1e3, False)):
        prefill, reads = _reads_posted_together(wake_s)
        posted = reads[0].transfer_queued
        assert all(r.transfer_queued == posted for r in reads)
        step_end = next(t for t in prefill.step_ends if t > posted)
        served = reads[0].transfer_start
        assert [r.transfer_start for r in reads] == pytest.approx([served, served + wire, served + 2 * wire])
        if served_before_step_end:
            assert posted < served < posted + 0.01 * (step_end - posted)
        else:  # when the long prompt's last step ends (1,788 tokens after the first step, 512 a step), or just
            # after its own read, posted at that instant, has had the lane
            idle = prefill.step_ends[-1]
            assert len(prefill.step_ends) == 5
            assert idle - 1e-9 <= served <= idle + wire * 20 + 1e-9


def test_a_busy_senders_wake_ups_come_at_exponential_gaps_of_their_mean() -> None:
    """Over 300 seeds, a read posted as the sender starts its last 4 steps waits min(wake-up, idle): for exponential
    gaps of mean m and a busy time L that averages m (1 - exp(-L/m)); here m = L/2."""
    import math

    prefill, reads = _reads_posted_together(1e3)
    posted = reads[0].transfer_queued
    step = prefill.step_ends[-1] - posted
    mean = step / 2
    waits = []
    for seed in range(300):
        _, reads = _reads_posted_together(mean, seed)
        waits.append(reads[0].transfer_start - reads[0].transfer_queued)
    long_read = _tcp_transfer().transfer_time(2000)
    assert max(waits) <= step + long_read + 1e-9  # (at idle the long prompt's own read may take the lane first)
    assert sum(waits) / len(waits) == pytest.approx(mean * (1 - math.exp(-step / mean)), rel=0.08)


@pytest.mark.parametrize("cv", [0.0, 0.5, 1.0])
def test_a_read_posted_at_any_moment_waits_for_the_rest_of_a_length_biased_gap(cv: float) -> None:
    """Wake-ups are a renewal process in equilibrium from the moment the sender starts computing: over 300 seeds
    a read posted a step into it waits on average m (1 + cv^2) / 2 for gaps of mean m (here a tenth of the busy
    time, so going idle hardly ever serves it first): half a gap when they are regular, a whole mean when they are
    exponential. With regular gaps no read waits longer than one."""
    prefill, reads = _reads_posted_together(1e3)
    step = prefill.step_ends[-1] - reads[0].transfer_queued
    mean = step / 10
    waits = []
    for seed in range(300):
        _, reads = _reads_posted_together(mean, seed, cv)
        waits.append(reads[0].transfer_start - reads[0].transfer_queued)
    assert sum(waits) / len(waits) == pytest.approx(mean * (1 + cv * cv) / 2, rel=0.1)
    if cv == 0.0:
        assert max(waits) <= mean + 1e-9


def test_a_disaggregated_request_posts_its_read_when_the_decode_instances_prefill_leaves_budget() -> None:
    """The decode instance prefills a 390-token prompt of its own in 64-token chunks when a disaggregated request
    reaches it: the request waits in the same queue (vLLM schedules running requests first, and a chunk that fills
    the budget holds back everything behind it), posts its read at the first step with budget left, and joins the
    batch only after the step in which its KV arrived; its first token comes at the end of the step it joins."""
    catalog = load_catalog()
    transfer = TransferCost(catalog.links["tcp-10gbe"], kv_bytes_per_token=1000, num_layers=4)
    # (the prefill instance prices every pair alike, which puts its answer inside the decode instance's sixth chunk)
    prefill = instance("p", "prefill", link=Link(transfer), cost=FittedCost(COST.coefficients[:5]))
    decode = instance("d", "decode", budget=64)
    sim = Simulation(router=RouterSettings(threshold=400), prefill=[prefill], decode=[decode])
    own, remote = sim.run([Arrival(at_s=0.0, prompt_tokens=390, output_tokens=20, cls="short"),
                           Arrival(at_s=0.0, prompt_tokens=400, output_tokens=2, cls="long")])
    assert (own.path, remote.path) == ("direct", "disaggregated")
    ends = decode.step_ends
    assert ends[0] == pytest.approx(first_chunk(64))
    assert ends[4] < remote.prefill_end < ends[5]  # handed over during the sixth full chunk
    assert ends[6] - ends[5] == pytest.approx(COST.step_time(6, chunk_attention(6, 384), 0, 0))  # the last chunk
    assert remote.transfer_queued == pytest.approx(ends[5])  # the first step that leaves budget
    assert remote.transfer_end < ends[6]
    assert remote.transfer_seen == pytest.approx(ends[6])  # the connector notices it between steps (vLLM's count)
    assert token_times(remote)[0] == pytest.approx(ends[7])  # arrived during step 7, joined step 8
    assert token_times(own)[0] == pytest.approx(ends[6])


def test_step_jitter_draws_from_the_quantiles_and_adds_to_every_step_alike() -> None:
    jitter = (-0.002, 0.0, 0.002)  # uniform between -2 and +2 ms: mean 0
    offsets = ServingOverheads(step_jitter_s=jitter).step_jitters(seed=3)
    drawn = [next(offsets) for _ in range(20_000)]
    assert min(drawn) >= -0.002 and max(drawn) <= 0.002
    assert sum(drawn) / len(drawn) == pytest.approx(0.0, abs=5e-5)
    inst = instance("colocated-0", "colocated")
    sim = Simulation(router=RouterSettings(), colocated=[inst], overheads=ServingOverheads(step_jitter_s=jitter))
    [request] = sim.run([Arrival(0.0, 10, 400, "short")])
    gaps = [b - a for a, b in zip(token_times(request), token_times(request)[1:], strict=False)]
    nominal = COST.step_time(0, 0, 1, 200)
    assert min(gaps) < nominal - 0.001 and max(gaps) > nominal + 0.001  # steps vary...
    assert sum(gaps) / len(gaps) == pytest.approx(nominal, rel=0.05)  # ...around the cost model's time
    # Additive: a long prefill step strays by the same few milliseconds, not by the same fraction.
    sim = Simulation(router=RouterSettings(), colocated=[instance("colocated-1", "colocated")],
                     overheads=ServingOverheads(step_jitter_s=jitter))
    [long] = sim.run([Arrival(0.0, 2000, 1, "long")])
    prefill = first_chunk(2000)
    assert abs(token_times(long)[0] - prefill) <= 0.002 + 1e-9


def test_a_p_d_deployment_draws_its_steps_variation_from_its_own_quantiles() -> None:
    catalog = load_catalog()
    transfer = TransferCost(catalog.links["tcp-10gbe"], kv_bytes_per_token=1000, num_layers=4)
    # Constant offsets, so every step shows which table it drew from: none for a colocated instance, +4 ms on a
    # P/D pair (a short prompt under the threshold streams from the decode instance alone).
    overheads = ServingOverheads(step_jitter_s=(0.0, 0.0), step_jitter_pd_s=(0.004, 0.004))
    colocated = Simulation(router=RouterSettings(threshold=100), colocated=[instance("c", "colocated")],
                           overheads=overheads)
    pair = Simulation(router=RouterSettings(threshold=100), prefill=[instance("p", "prefill", link=Link(transfer))],
                      decode=[instance("d", "decode")], overheads=overheads)
    for sim, offset in ((colocated, 0.0), (pair, 0.004)):
        [request] = sim.run([Arrival(0.0, 10, 20, "short")])
        times = token_times(request)
        assert times[0] == pytest.approx(first_chunk(10) + offset)
        assert times[2] - times[1] == pytest.approx(COST.step_time(0, 0, 1, 12) + offset)
    # Without a P/D table, a P/D pair draws from the one table, as profiles fitted before it do.
    pair = Simulation(router=RouterSettings(threshold=100), prefill=[instance("p", "prefill", link=Link(transfer))],
                      decode=[instance("d", "decode")], overheads=ServingOverheads(step_jitter_s=(0.002, 0.002)))
    [request] = pair.run([Arrival(0.0, 10, 20, "short")])
    assert token_times(request)[0] == pytest.approx(first_chunk(10) + 0.002)
    again = ServingOverheads.from_json(overheads.to_json())
    assert again.step_jitter_pd_s == pytest.approx((0.004, 0.004)) and again.step_jitter_s == pytest.approx((0, 0))


def test_a_profile_with_step_variation_as_a_factor_is_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match="re-fit it with `pdlab sim calibrate --from-runs"):
        ServingOverheads.from_json({"request_ms": 3.0, "step_quantiles": [0.5, 1.0, 1.5]})
    round_trip = ServingOverheads(0.003, 0.004, (-0.001, 0.0, 0.002), transfer_waits_for_sender=True,
                                  request_per_stream_s=0.0015)
    again = ServingOverheads.from_json(round_trip.to_json())
    assert (again.request_s, again.handoff_s, again.request_per_stream_s) == pytest.approx((0.003, 0.004, 0.0015))
    assert again.step_jitter_s == pytest.approx(round_trip.step_jitter_s) and again.transfer_waits_for_sender
    assert not ServingOverheads.from_json({}).transfer_waits_for_sender  # not unless a profile says so


@pytest.mark.parametrize("admission_s", [0.0, 0.002])
def test_requests_arriving_while_an_idle_instance_wakes_share_its_first_step(admission_s: float) -> None:
    """Two prompts 1 ms apart at an idle instance: with a 2 ms admission window the first step, begun 2 ms after the
    first arrived, takes both (first tokens together); without one, the second waits for the first's step."""
    alone = instance("c", "colocated")
    overheads = ServingOverheads(admission_s={"colocated": admission_s, "decode": 1.0})  # another role's: unused
    sim = Simulation(router=RouterSettings(), colocated=[alone], overheads=overheads)
    first, second = sim.run([Arrival(0.0, 100, 2, "short"), Arrival(0.001, 200, 2, "short")])
    if admission_s:
        both = COST.step_time(300, chunk_attention(100, 0) + chunk_attention(200, 0), 0, 0,
                              chunk_attention(100, 0) + chunk_attention(200, 0))
        assert token_times(first)[0] == token_times(second)[0] == pytest.approx(admission_s + both)
    else:
        assert token_times(first)[0] == pytest.approx(first_chunk(100))
        assert token_times(second)[0] > token_times(first)[0] + first_chunk(200) * 0.9


def test_prompts_queued_back_to_back_share_steps_priced_by_their_chunks_squares() -> None:
    """Two 300-token prompts sent together, a 200-token budget: steps of [A 200], [A 100 + B 100], [B 200]. Each
    step pays the squares of its chunks (chunk_square) beside their causal pairs; B's first chunk is fresh, its
    second reads the 100 tokens before it."""
    cost = FittedCost((0.010, 0.001, 1e-6, 0.002, 1e-6, 0.0, 3e-7))
    inst = instance("colocated-0", "colocated", budget=200, cost=cost)
    a, b = Simulation(router=RouterSettings(), colocated=[inst]).run(
        [Arrival(0.0, 300, 1, "long"), Arrival(0.0, 300, 1, "long")])

    def step(*chunks: tuple[int, int]) -> float:
        pairs = sum(chunk_attention(chunk, done) for chunk, done in chunks)
        fresh = sum(chunk_attention(chunk, done) for chunk, done in chunks if done == 0)
        return cost.step_time(sum(c for c, _ in chunks), pairs, 0, 0, fresh, sum(c * c / 2 for c, _ in chunks))

    first, second, third = step((200, 0)), step((100, 200), (100, 0)), step((200, 100))
    assert token_times(a)[0] == pytest.approx(first + second)
    assert token_times(b)[0] == pytest.approx(first + second + third)
    assert second == pytest.approx(0.010 + 0.2 + 1e-6 * (100 * 250 + 100 * 50) + 3e-7 * (5000 + 5000))


def test_two_requests_on_one_colocated_instance_interleave_decode_first() -> None:
    inst = instance("colocated-0", "colocated")
    sim = Simulation(router=RouterSettings(), colocated=[inst])
    a, b = sim.run([Arrival(0.0, 100, 3, "long"), Arrival(0.001, 50, 2, "short")])

    step1 = first_chunk(100)  # A's prefill alone: B has not arrived
    step2 = first_chunk(50, 1, 101)  # A decodes (context 101) while B prefills
    step3 = COST.step_time(0, 0, 2, 102 + 51)  # both decode
    assert list(token_times(a)) == pytest.approx([step1, step1 + step2, step1 + step2 + step3])
    assert list(token_times(b)) == pytest.approx([step1 + step2, step1 + step2 + step3])
    assert inst.running == 0 and inst.context == 0 and inst.kv_used == 0


def test_chunked_prefill_budget_splits_a_long_prompt_and_keeps_decodes_running() -> None:
    inst = instance("colocated-0", "colocated", budget=64)
    sim = Simulation(router=RouterSettings(), colocated=[inst])
    short, long = sim.run([Arrival(0.0, 10, 20, "short"), Arrival(0.0005, 200, 2, "long")])
    gaps = [t2 - t1 for t1, t2 in zip(token_times(short)[:-1], token_times(short)[1:], strict=True)]
    # With budget 64 and one decode, the 200-token prompt takes ceil(200/63) = 4 steps of at most 63 tokens.
    assert inst.step_ends and max(gaps) <= COST.step_time(63, chunk_attention(63, 137), 1, 40) + 1e-12
    assert token_times(long)[0] > token_times(short)[3]


def test_a_prompt_waits_for_kv_space_for_its_first_chunk() -> None:
    inst = Instance(name="colocated-0", role="colocated", cost=COST, budget=8192, max_seqs=64, kv_capacity=150)
    sim = Simulation(router=RouterSettings(), colocated=[inst])
    a, b = sim.run([Arrival(0.0, 100, 10, "short"), Arrival(0.0, 100, 10, "short")])
    assert token_times(b)[0] > a.finish  # b's 100 tokens fit only after a (100, growing to 110) leaves 150 slots
    assert a.preemptions == b.preemptions == 0
    # Chunked (a 64-token budget): b's next chunk would fit beside a's first two, but its whole prompt does not.
    chunked = Instance(name="colocated-0", role="colocated", cost=COST, budget=64, max_seqs=64, kv_capacity=150)
    a, b = Simulation(router=RouterSettings(), colocated=[chunked]).run(
        [Arrival(0.0, 100, 10, "short"), Arrival(0.0, 100, 10, "short")])
    assert token_times(b)[0] > a.finish and chunked.preemptions == 0
    too_big = Simulation(router=RouterSettings(), colocated=[instance("c", "colocated")]).run(
        [Arrival(0.0, 200_000, 1, "long")])[0]
    assert too_big.failed is not None


def _preemption_check(inst: Instance, a, b, cut: int) -> None:
    """Two 50-token prompts with 40 tokens each, both running in eight 16-token blocks (four each): when their
    sequences need a fifth block (at 65 tokens), the later one is preempted with `cut` tokens, waits for the
    room to compute its 50 + `cut` tokens again (five blocks: three are free beside the other's five), and
    produces the rest."""
    assert a.preemptions == 0 and b.preemptions == 1 and inst.preemptions == 1
    a_times, b_times = token_times(a), token_times(b)
    assert len(a_times) == len(b_times) == 40
    assert b_times[cut - 1] < a_times[cut + 1] and b_times[cut] > a.finish
    assert b_times[cut] - a.finish == pytest.approx(first_chunk(50 + cut))  # recompute: one prefill of them all
    assert list(b_times[cut + 1:] - b_times[cut:-1]) == pytest.approx(
        [COST.step_time(0, 0, 1, 50 + cut + i) for i in range(1, 40 - cut)])
    assert a_times[-1] - a_times[-2] == pytest.approx(COST.step_time(0, 0, 1, 89))  # a ran alone at the end
    assert inst.kv_used == inst.context == inst.running == 0 and not inst.admitted


def test_a_running_request_without_kv_space_preempts_the_latest_admitted_which_computes_its_tokens_again() -> None:
    inst = Instance(name="colocated-0", role="colocated", cost=COST, budget=8192, max_seqs=64, kv_capacity=128,
                    block_size=16)
    a, b = Simulation(router=RouterSettings(), colocated=[inst]).run(
        [Arrival(0.0, 50, 40, "short"), Arrival(0.0, 50, 40, "short")])
    pairs = 2 * chunk_attention(50, 0)
    assert token_times(a)[0] == token_times(b)[0] == pytest.approx(COST.step_time(100, pairs, 0, 0, pairs))
    _preemption_check(inst, a, b, cut=15)  # the step computing each one's 15th token needs its 65th slot
    summary = summarize([a, b], stall_ms=100, ttft_slo_ms=1000, tpot_slo_ms=100)
    assert summary["preemptions"] == 1 and summary["requests"]["completed"] == 2


def test_a_disaggregated_request_preempted_on_its_decode_instance_is_recomputed_there() -> None:
    catalog = load_catalog()
    transfer = TransferCost(catalog.links["tcp-10gbe"], kv_bytes_per_token=1000, num_layers=4)
    prefill = instance("prefill-0", "prefill", link=Link(transfer))
    decode = Instance(name="decode-0", role="decode", cost=COST, budget=8192, max_seqs=64, kv_capacity=128,
                      block_size=16)
    a, b = Simulation(router=RouterSettings(threshold=0), prefill=[prefill], decode=[decode]).run(
        [Arrival(0.0, 50, 40, "long"), Arrival(0.0, 50, 40, "long")])
    assert a.path == b.path == "disaggregated"
    assert len(prefill.step_ends) == 1  # the prefill instance computed each prompt once, in one step
    _preemption_check(decode, a, b, cut=14)  # b's KV arrived a step after a's (one lane)
    assert prefill.kv_used == 0 and decode.decode_blocks == 0 and not any(decode.grow_at.values())


def test_kv_space_is_counted_in_whole_blocks() -> None:
    """vLLM allocates KV in blocks (128 tokens in the CPU tier): a 129-token prompt takes two of a two-block
    cache, so a 10-token prompt waits although 139 tokens would fit in 256 slots; and a sequence whose next
    token opens a block needs that block before its step."""
    inst = Instance(name="c", role="colocated", cost=COST, budget=8192, max_seqs=64, kv_capacity=256, block_size=128)
    a, b = Simulation(router=RouterSettings(), colocated=[inst]).run(
        [Arrival(0.0, 129, 3, "short"), Arrival(0.0, 10, 3, "short")])
    assert token_times(b)[0] > a.finish and a.preemptions == b.preemptions == 0
    # Two 120-token prompts take a block each of three. The step that computes a sequence's 9th token writes its
    # 129th slot, in a second block, and the cache has one more: the later request is preempted there, with 9.
    inst = Instance(name="c", role="colocated", cost=COST, budget=8192, max_seqs=64, kv_capacity=384, block_size=128)
    a, b = Simulation(router=RouterSettings(), colocated=[inst]).run(
        [Arrival(0.0, 120, 20, "short"), Arrival(0.0, 120, 20, "short")])
    assert a.preemptions == 0 and b.preemptions == 1
    assert b.segments is not None and b.segments[0][2] == 9 and len(token_times(b)) == 20
    assert inst.kv_used == inst.decode_blocks == inst.context == 0

def spec(**overrides) -> SimSpec:
    base = {"model": "Llama-3.1-8B", "hardware": "H100-SXM5-80GB", "pools": {"prefill": 1, "decode": 1},
            "router": {"threshold": 1024},
            "workload": {"poisson": {"rate_rps": 8, "num_requests": 300, "seed": 1}}}
    base.update(overrides)
    return SimSpec.model_validate(base)


def test_threshold_zero_sends_everything_disaggregated() -> None:
    summary, sim = simulate(spec(router={"threshold": 0}))
    assert summary["paths"] == {"direct": 0, "disaggregated": 300}
    assert all(path == "disaggregated" for _, path, _, _ in sim.decisions)


def test_more_bandwidth_never_hurts_ttft() -> None:
    ttfts = []
    for gbps in (1, 10, 100, 1000):
        summary, _ = simulate(spec(link={"name": "tcp-10gbe", "bandwidth_gbps": gbps}))
        ttfts.append((summary["long"]["ttft_ms"]["p50"], summary["long"]["ttft_ms"]["p99"]))
    for slower, faster in zip(ttfts, ttfts[1:], strict=False):
        assert faster[0] <= slower[0] + 1e-9 and faster[1] <= slower[1] + 1e-9


def test_layerwise_overlap_hides_transfer() -> None:
    plain, _ = simulate(spec(link={"name": "tcp-10gbe"}))
    overlapped, _ = simulate(spec(link={"name": "tcp-10gbe", "layerwise_overlap": True}))
    assert overlapped["long"]["ttft_ms"]["p50"] < plain["long"]["ttft_ms"]["p50"]


def test_colocated_prefills_stall_decodes_more_than_disaggregated() -> None:
    """The lab's whole point, on a roofline H100: long prompts in the decode batch stretch short streams' gaps."""
    workload = {"poisson": {"rate_rps": 6, "num_requests": 300, "long_fraction": 0.3, "long_prompt_tokens": 8000,
                            "seed": 2}}
    colocated, _ = simulate(spec(pools={"colocated": 2}, workload=workload))
    disaggregated, _ = simulate(spec(pools={"prefill": 1, "decode": 1}, workload=workload))
    assert disaggregated["short"]["itl_ms"]["max"] < colocated["short"]["itl_ms"]["max"]


def test_roofline_step_time_grows_with_work() -> None:
    catalog = load_catalog()
    cost = RooflineCost(catalog.hardware["H200-SXM-141GB"], catalog.models["Llama-3.1-70B"], 2, 2,
                        catalog.links["nvlink4"])
    assert cost.step_time(0, 0, 0, 0) == 0
    assert cost.step_time(0, 0, 1, 100) < cost.step_time(0, 0, 64, 64 * 4000)
    assert cost.step_time(512, chunk_attention(512, 0), 0, 0) < cost.step_time(8192, chunk_attention(8192, 0), 0, 0)


def test_tensor_parallel_steps_add_the_all_reduces_alpha_beta_time() -> None:
    """Llama-3.1-8B over 2 x H200 on NVLink: 2 all-reduces per layer and one after the embedding, each of the
    step's tokens' hidden states, plus a gather of each sampled row's logits; a free link costs nothing."""
    catalog = load_catalog()
    hardware, model = catalog.hardware["H200-SXM-141GB"], catalog.models["Llama-3.1-8B"]
    nvlink = catalog.links["nvlink4"]
    free_link = nvlink.model_copy(update={"bandwidth_gbps": 1e15, "latency_us": 0.0})
    on_nvlink = RooflineCost(hardware, model, 2, 2, nvlink)
    for_free = RooflineCost(hardware, model, 2, 2, free_link)
    bytes_per_s, latency = 3600e9 / 8 * 0.8, 3e-6
    all_reduces = 2 * 32 + 1
    for prefill, decodes in ((0, 1), (0, 64), (2048, 0), (1024, 32)):
        tokens, rows = prefill + decodes, decodes + (1 if prefill else 0)
        expected = ((all_reduces + 1) * 2 * latency  # ceil(log2 2) = 1: one reduce and one broadcast hop
                    + all_reduces * 2 * (1 / 2) * tokens * 4096 * 2 / bytes_per_s
                    + (1 / 2) * rows * 128_256 * 2 / bytes_per_s)
        attention = chunk_attention(prefill, 0)
        added = on_nvlink.step_time(prefill, attention, decodes, decodes * 1000) \
            - for_free.step_time(prefill, attention, decodes, decodes * 1000)
        assert added == pytest.approx(expected, rel=1e-6)
    # One GPU exchanges nothing, and needs no interconnect.
    alone = RooflineCost(hardware, model, 2, 1)
    assert alone.step_time(0, 0, 8, 8000) == RooflineCost(hardware, model, 2, 1, nvlink).step_time(0, 0, 8, 8000)
    with pytest.raises(ValueError, match="interconnect"):
        RooflineCost(hardware, model, 2, 4)


def test_a_faster_tensor_parallel_link_never_slows_a_step_and_pcie_pays_more_than_nvlink() -> None:
    catalog = load_catalog()
    hardware, model = catalog.hardware["H100-SXM5-80GB"], catalog.models["Llama-3.1-70B"]
    steps = [(0, 0, 1, 500), (0, 0, 128, 128 * 3000), (8192, chunk_attention(8192, 0), 0, 0),
             (4096, chunk_attention(4096, 4096), 64, 64 * 2000)]
    for tp in (2, 4, 8):
        nvlink = RooflineCost(hardware, model, 2, tp, catalog.links["nvlink4"])
        pcie = RooflineCost(hardware, model, 2, tp, catalog.links["pcie4-x16"])
        for step in steps:
            assert nvlink.step_time(*step) < pcie.step_time(*step)
    # More GPUs still shorten a decode step of 70B, but by less than their number: 8 are not 8x faster than 1.
    one = RooflineCost(hardware, model, 2, 1)
    eight = RooflineCost(hardware, model, 2, 8, catalog.links["nvlink4"])
    assert one.step_time(0, 0, 1, 500) / 8 < eight.step_time(0, 0, 1, 500) < one.step_time(0, 0, 1, 500)


@pytest.mark.parametrize(("model", "tp", "message"), [
    ("Llama-3.1-70B", 16, "more than one H200-SXM-141GB node"),
    ("Llama-3.1-8B", 3, "32 attention heads do not split over 3"),
    ("Qwen2.5-7B", 8, "28 attention heads do not split over 8"),
])
def test_a_tensor_parallel_size_vllm_would_refuse_names_the_field(model: str, tp: int, message: str) -> None:
    with pytest.raises(ConfigError, match="engine.tensor_parallel") as error:
        prepare(spec(model=model, hardware="H200-SXM-141GB", engine={"tensor_parallel": tp}))
    assert message in str(error.value)


def test_more_gpus_than_kv_heads_hold_copies_of_them() -> None:
    """vLLM replicates KV heads when the tensor-parallel size exceeds their number: each GPU then holds a copy of
    its head's KV, and the instance's KV capacity in tokens shrinks by the copies."""
    catalog = load_catalog()
    base = catalog.models["Llama-3.1-8B"]
    catalog.models["gqa-8"] = base  # 8 KV heads: split over 4 GPUs
    catalog.models["gqa-2"] = base.model_copy(update={"num_kv_heads": 2})  # replicated twice over 4 GPUs
    engine = {"tensor_parallel": 4, "gpu_memory_utilization": 0.9}
    wide = prepare(spec(model="gqa-8", hardware="H200-SXM-141GB", engine=engine), catalog)
    narrow = prepare(spec(model="gqa-2", hardware="H200-SXM-141GB", engine=engine), catalog)
    def free(model: str) -> float:  # bytes left for KV on the 4 GPUs
        return 141 * 2**30 * 4 * 0.9 - catalog.models[model].params * 2

    assert wide.kv_capacity == int(free("gqa-8") // base.kv_bytes_per_token(2))
    assert narrow.kv_capacity == int(free("gqa-2") // (catalog.models["gqa-2"].kv_bytes_per_token(2) * 2))


def test_a_tensor_parallel_instance_moves_its_kv_over_every_gpus_share_of_the_link() -> None:
    """One disaggregated request, Llama-3.1-8B on H200s over EFA (p5en): at tp 4 the KV read takes a quarter of
    its wire time at tp 1 (the latency stays)."""
    workload = {"requests": [{"at_s": 0, "prompt_tokens": 8000, "output_tokens": 2, "cls": "long"}]}
    reads = {}
    for tp in (1, 4):
        prepared = prepare(spec(hardware="H200-SXM-141GB", link={"name": "efa-p5en"}, router={"threshold": 0},
                                engine={"tensor_parallel": tp}, workload=workload))
        assert prepared.link.bandwidth_gbps == 400 * tp
        summary, sim = simulate(prepared.spec)
        request = sim.requests[0]
        reads[tp] = request.transfer_end - request.transfer_start
    latency = 12e-6
    wire = 8000 * load_catalog().models["Llama-3.1-8B"].kv_bytes_per_token(2) / (400e9 / 8 * 0.8)
    assert reads[1] == pytest.approx(latency + wire, rel=1e-6)
    assert reads[4] == pytest.approx(latency + wire / 4, rel=1e-6)


def test_a_gpu_profile_of_a_shard_adds_the_exchange_and_keeps_the_gpus_memory(tmp_path) -> None:
    """A profile `python -m pdlab.benchmarks.gpu_phases --tensor-parallel 2` would write: its steps are one GPU's shard
    of the forward pass; the simulated instance adds the shards' all-reduces over the accelerator's NVLink and the
    serving engine's work per step, and sizes its KV cache from the GPUs' memory, as the roofline does."""
    import json

    from pdlab.sim.costs import BASE_FEATURES, ForwardPassCost, TensorParallelExchange

    shard = [0.004, 3e-5, 1e-10, 2e-5, 1e-8]
    path = tmp_path / "h200-tp2.json"
    path.write_text(json.dumps({"kind": "fitted", "features": list(BASE_FEATURES), "coefficients": shard,
                                "gpu": "NVIDIA-H200", "tensor_parallel": 2, "model": "Llama-3.1-70B",
                                "source": "a shard's steps"}))
    path.with_name("h200.json").write_text(json.dumps({**json.loads(path.read_text()), "tensor_parallel": 1,
                                                       "model": "Llama-3.1-8B"}))
    fields = {"model": "Llama-3.1-70B", "hardware": "H200-SXM-141GB", "profile": str(path)}
    prepared = prepare(spec(**fields, engine={"tensor_parallel": 2}))
    assert isinstance(prepared.cost, ForwardPassCost) and "x2 over nvlink4" in prepared.cost_source
    catalog = load_catalog()
    exchange = TensorParallelExchange(catalog.models["Llama-3.1-70B"], 2, catalog.links["nvlink4"])
    serving = catalog.hardware["H200-SXM-141GB"].step_overhead_ms / 1e3
    step = (4096, chunk_attention(4096, 0), 16, 16 * 2000)
    assert prepared.cost.step_time(*step) == pytest.approx(
        FittedCost(tuple(shard)).step_time(*step) + exchange.time(4096 + 16, 16 + 1) + serving, rel=1e-12)
    one_gpu = prepare(spec(model="Llama-3.1-8B", hardware="H200-SXM-141GB", profile=str(path.with_name("h200.json"))))
    assert one_gpu.cost.step_time(*step) == pytest.approx(FittedCost(tuple(shard)).step_time(*step) + serving)
    roofline = prepare(spec(model="Llama-3.1-70B", hardware="H200-SXM-141GB", engine={"tensor_parallel": 2}))
    assert prepared.kv_capacity == roofline.kv_capacity
    with pytest.raises(ConfigError, match="engine.tensor_parallel") as error:
        prepare(spec(**fields, engine={"tensor_parallel": 4}))
    assert "timed a shard of 2 GPU(s)" in str(error.value)
    with pytest.raises(ConfigError, match="timed 1 GPU"):  # the CPU tier's profile: one instance, no shards
        prepare(spec(model="pdlab-small", profile="pdlab-small-fitted", engine={"tensor_parallel": 2}))


def test_a_copy_with_another_cost_prices_every_pool_with_it() -> None:
    """As a fit tries costs (`dataclasses.replace(prepared, cost=...)`): without a prefill engine of its own, the
    prefill pool takes the copy's cost too."""
    from dataclasses import replace

    from pdlab.sim.scenario import build

    trial = FittedCost((0.01, 1e-5, 0.0, 1e-4, 0.0))
    sim = build(replace(prepare(spec()), cost=trial, kv_capacity=12345))
    assert all(inst.cost is trial and inst.kv_capacity == 12345 for inst in sim.prefill_pool + sim.decode_pool)


def test_kv_capacity_from_memory_and_model_that_does_not_fit() -> None:
    prepared = prepare(spec(model="Llama-3.1-70B", hardware="H200-SXM-141GB", engine={"tensor_parallel": 2}))
    assert prepared.kv_capacity > 100_000
    with pytest.raises(ValueError, match="tensor_parallel"):
        prepare(spec(model="Llama-3.1-70B", hardware="L40S"))


def test_a_prefix_cache_skips_the_leading_blocks_the_instance_computed_before() -> None:
    """With prefix caching a prompt prefills only what follows its leading blocks found in the instance's cache
    (at least its last token, whose logits vLLM needs); without the cache, or once its blocks are evicted (least
    recently used first, at the KV capacity), it computes everything again."""
    from collections import OrderedDict

    blocks = (11, 12, 13, 14, 15, 16)  # six 16-token blocks: 96 of a 100-token prompt
    others = (21, 22, 23, 24, 25, 26)

    def last_ttft(hashes: tuple[int, ...], *, before: tuple[tuple[int, ...], ...] = (blocks,), caching: bool = True,
                  kv_capacity: int = 100_000, prompt: int = 100) -> float:
        inst = Instance(name="c", role="colocated", cost=COST, budget=8192, max_seqs=64, kv_capacity=kv_capacity,
                        prefix_cache=OrderedDict() if caching else None, block_size=16)
        sim = Simulation(router=RouterSettings(threshold=100_000), colocated=[inst])
        done = sim.run([Arrival(10.0 * i, prompt, 1, "short", prefix_hashes=earlier)
                        for i, earlier in enumerate(before)]
                       + [Arrival(10.0 * len(before), prompt, 1, "short", prefix_hashes=hashes)])
        assert done[0].cached == 0
        return float(token_times(done[-1])[0]) - 10.0 * len(before)

    def chunk_after(cached: int, tokens: int) -> float:
        return COST.step_time(tokens, chunk_attention(tokens, cached), 0, 0, 0.0)

    assert last_ttft(blocks, caching=False) == pytest.approx(first_chunk(100))
    assert last_ttft(blocks) == pytest.approx(chunk_after(96, 4))
    assert last_ttft(blocks[:3] + (97, 98, 99)) == pytest.approx(chunk_after(48, 52))  # a shared beginning
    assert last_ttft((97, *blocks[1:])) == pytest.approx(first_chunk(100))  # chained hashes: no leading match
    assert last_ttft(blocks, prompt=96) == pytest.approx(chunk_after(95, 1))  # the last token is computed again
    # 150 tokens of KV hold 9 blocks: another prompt's six push out the first three of ours, and with them the match.
    assert last_ttft(blocks, before=(blocks, others), kv_capacity=150) == pytest.approx(first_chunk(100))
    assert last_ttft(blocks, before=(blocks, others)) == pytest.approx(chunk_after(96, 4))


def test_the_uncached_threshold_basis_sends_a_follow_up_turn_direct_to_the_decode_instance_that_holds_its_prefix(
) -> None:
    """A 1P1D pair, threshold 1,000 tokens, prefix caching on the decode instance. A 1,200-token first turn is
    prefilled remotely either way. Its 1,296-token follow-up (the first turn's 75 blocks, then six new ones):
    `prompt` counts 1,296 tokens and prefills all of them remotely again; `uncached` counts the 96 the decode
    instance does not hold (the router's model: the first turn finished there) and sends it direct, where the
    decode instance's prefix cache computes only those. An unrelated long prompt is still disaggregated."""
    from collections import OrderedDict

    catalog = load_catalog()
    transfer = TransferCost(catalog.links["tcp-10gbe"], kv_bytes_per_token=1000, num_layers=4)
    first_turn = tuple(range(1, 76))
    follow_up = (*first_turn, *range(101, 107))
    other = tuple(range(201, 282))

    def run(basis: str) -> list:
        prefill = Instance(name="p", role="prefill", cost=COST, budget=8192, max_seqs=64, kv_capacity=100_000,
                           link=Link(transfer), block_size=16)
        decode = Instance(name="d", role="decode", cost=COST, budget=8192, max_seqs=64, kv_capacity=100_000,
                          prefix_cache=OrderedDict(), block_size=16)
        sim = Simulation(router=RouterSettings(threshold=1000, threshold_basis=basis), prefill=[prefill],
                         decode=[decode])
        return sim.run([Arrival(0.0, 1200, 2, "long", prefix_hashes=first_turn),
                        Arrival(10.0, 1296, 2, "long", prefix_hashes=follow_up),
                        Arrival(20.0, 1296, 2, "long", prefix_hashes=other)])

    by_prompt, by_uncached = run("prompt"), run("uncached")
    assert [(r.path, r.reason) for r in by_prompt] == [("disaggregated", "over_threshold")] * 3
    assert [(r.path, r.reason) for r in by_uncached] == [
        ("disaggregated", "over_threshold"), ("direct", "cached_prefix"), ("disaggregated", "over_threshold")]
    follow = by_uncached[1]
    assert follow.decode_instance == "d" and follow.prefill_instance is None
    assert follow.cached == 1200, "the decode instance computes only the new blocks"
    assert token_times(follow)[0] < token_times(by_prompt[1])[0]


def test_a_trace_replays_with_shared_blocks_for_equal_leading_hash_ids(tmp_path) -> None:
    from pdlab.config.sim import SimTrace, SimWorkload
    from pdlab.sim.workload import arrivals

    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 8, "hash_ids": [1, 2, 3]},
            {"timestamp": 500, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]},
            {"timestamp": 1000, "input_length": 1100, "output_length": 8, "hash_ids": [1, 9, 3]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    first, second, third = arrivals(SimWorkload(trace=SimTrace(path=str(path), time_scale=0.5)), block_size=16)
    assert [a.at_s for a in (first, second, third)] == [0.0, 0.25, 0.5]
    assert len(first.prefix_hashes) == 1100 // 16 and len(second.prefix_hashes) == 1024 // 16
    assert second.prefix_hashes == first.prefix_hashes[:64]  # two 512-token ids, as 16-token blocks
    assert third.prefix_hashes[:32] == first.prefix_hashes[:32] and third.prefix_hashes[32] != first.prefix_hashes[32]
    assert third.prefix_hashes[64] != first.prefix_hashes[64], "a block after a difference is a different block"
    with pytest.raises(ValueError, match="exactly one of"):
        SimWorkload(trace=SimTrace(path=str(path)), requests=[{"at_s": 0, "prompt_tokens": 1, "output_tokens": 1}])


def test_a_classs_percentiles_are_numpys_to_the_last_bit() -> None:
    """The simulator's summary takes p50/p99 without numpy's per-call overhead; the result must be numpy's own."""
    import numpy as np

    from pdlab.sim.summary import _percentile, _stats

    rng = np.random.default_rng(0)
    for _ in range(2000):
        values = rng.exponential(1.0, int(rng.integers(1, 60))) * float(rng.choice([1e-3, 1.0, 1e3]))
        ordered = sorted(values.tolist())
        for q in (0, 1, 10, 37.5, 50, 90, 99, 100):
            assert _percentile(ordered, q) == float(np.percentile(values, q))
    with_nan = np.array([1.0, float("nan"), 3.0])
    assert np.isnan(_stats(with_nan)["p50"]) and _stats(np.empty(0))["p99"] is None


def test_step_offsets_do_not_depend_on_how_many_are_drawn_at_once() -> None:
    import itertools

    jitter = ServingOverheads(step_jitter_s=(-0.001, 0.0, 0.002, 0.01))
    small, large = (list(itertools.islice(jitter.step_jitters(seed=7, block=block), 1000)) for block in (256, 4096))
    assert small == large
