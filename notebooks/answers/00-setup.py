# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# Reference answers to notebook 00 (set-up, and a first P/D deployment by hand). Each answer runs after the
# notebook, in its kernel. The deployment is stopped by then (section 7), so the answers read what the notebook
# kept: the spec, the two calls' answers, the decode instance's NIXL counters (`before`, `moved`) and the instances'
# log files, which stay on disk after the stop.

# %% [markdown]
# ## Exercise 1
# The answer is the same: the weights are the same and decoding is greedy, so whichever instance computes the
# prompt's KV cache computes the same numbers, and the same tokens follow. Notebook 03 checks it live (section 5);
# its recorded full run wrote identical text both ways (read below). NIXL moves **0 bytes**: without
# `kv_transfer_params` the decode instance takes the request as an ordinary one and runs the prefill itself, so its
# connector has no remote blocks to pull (and the time to first token now includes that prefill).
#
# You can read this experiment in the counters the notebook already has: the warm-up in section 5 sent one
# 2,048-token prompt straight to the decode instance, then the same prompt through prefill -> decode, and `before`
# holds the decode instance's counters right after. Its connector was asked about both prompts, found the second
# one's tokens on the prefill instance, and made exactly one transfer, of the second prompt's blocks: the plain
# request moved nothing. To send it yourself, do it before section 7 stops the deployment:
# `httpx.post(f"{decode_url}/v1/completions", json=request, timeout=120)` between two
# `scrape_kv_transfer(decode_url)`.

# %%
import json
import math

from pdlab.model.shape import shape_of_dir
from pdlab.settings import VLLM_CPU_MAX_NUM_BATCHED_TOKENS, data_dir

warm_tokens = VLLM_CPU_MAX_NUM_BATCHED_TOKENS  # the warm-up prompt: one full step of vLLM's CPU token budget
per_token = shape_of_dir(dep.model_dir).kv_bytes_per_token()
print(f"after the warm-up, decode's connector had been asked about {before.connector_queried_tokens:g} prompt tokens "
      f"(two {warm_tokens}-token requests), found {before.connector_hit_tokens:g} on the prefill instance, and made "
      f"{before.transfers:g} transfer of {before.bytes / 1e6:.2f} MB")
assert before.connector_queried_tokens == 2 * warm_tokens and before.connector_hit_tokens == warm_tokens
assert before.transfers == 1 and before.bytes == math.ceil(warm_tokens / 128) * 128 * per_token

record = json.loads((data_dir() / "results/course-timings/20261205-113036-03.json").read_text())
outputs = "\n".join(cell["output"] for cell in record["notebooks"][0]["cells"])
pd_text, alone_text = (line.split(":", 1)[1].strip() for line in outputs.splitlines()
                       if line.startswith(("P/D:", "alone:")))
print(f"notebook 03, recorded: P/D {pd_text}\n                      alone {alone_text}")
assert pd_text == alone_text

# %% [markdown]
# ## Exercise 2
# The decode instance's command line gains `--max-num-batched-tokens 256`, and only the decode instance's: the
# token budget of one scheduler step, decode tokens and prefill tokens together. With chunked prefill a prompt
# longer than the budget is prefilled over several steps, so a smaller budget bounds how long one prefill can hold
# up the decodes running beside it (notebook 02's subject). A misspelled role is refused before anything runs: the
# error names the field by its path (`deployment.instances.1.role`) and says which values it accepts.

# %%
from pdlab.config import ConfigError, parse_lab
from pdlab.deploy import Deployment
from pdlab.deploy.plan import explain

budgeted = SPEC.replace("      role: decode ", "      engine: {max_num_batched_tokens: 256}\n      role: decode ", 1)
plans = {p.spec.role: p for p in Deployment(parse_lab(budgeted, source="budgeted").main_deployment())
         .dry_run().instances}
decode_argv = plans["decode"].argv
assert decode_argv[decode_argv.index("--max-num-batched-tokens") + 1] == "256"
assert "--max-num-batched-tokens" not in plans["prefill"].argv
rows = pd.DataFrame(explain(plans["decode"]))
print(rows[rows["name"] == "--max-num-batched-tokens"].to_string(index=False))

role_error = ""
try:
    parse_lab(SPEC.replace("role: decode ", "role: decoder ", 1), source="the spec with a misspelled role")
except ConfigError as error:
    role_error = str(error)
print(role_error)
assert "deployment.instances.1.role" in role_error and "'decode'" in role_error

# %% [markdown]
# ## Exercise 3
# They match exactly. A token's KV cache takes layers x 2 x KV heads x head size x 4 bytes; vLLM hands over whole
# 128-token blocks (one per started 128 tokens of the prompt, the last partly filled), so NIXL moved
# blocks x 128 x that many bytes. With a prompt just over a multiple of 128 tokens up to a block of padding moves
# with it. Notebook 03 does the same sum on a bigger model and across a link.

# %%
shape = shape_of_dir(dep.model_dir)
by_hand = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * 4
blocks = handed_over_blocks(handed_over)
expected = blocks * 128 * by_hand
print(f"{shape.num_layers} layers x 2 x {shape.num_kv_heads} KV heads x {shape.head_dim} x 4 bytes = {by_hand:,} "
      f"bytes a token; {first['usage']['prompt_tokens']} prompt tokens -> {blocks} blocks -> {expected / 1e6:.2f} MB "
      f"expected, {moved.bytes / 1e6:.2f} MB moved")
assert by_hand == shape.kv_bytes_per_token() and blocks == math.ceil(first["usage"]["prompt_tokens"] / 128)
assert moved.bytes == expected

# %% [markdown]
# ## Exercise 4
# Two lines, written during the warm-up in section 5, before any request of yours: `NIXL compatibility check
# passed (hash ...)`, when the decode instance fetched the prefill instance's NIXL metadata over its side channel
# and checked that both run compatible configurations (same model, dtype, KV layout), and `Transfer plan:
# TransferTopology(...)`, how it will read the remote blocks: `remote_block_len` is one block's K and V in one
# layer, so the layers times it is a 128-token block's bytes (exercise 3's sum). The handshake happens once per
# prefill instance, at the first transfer; that is why the warm-up makes one, so that no measured request pays
# for it. The prefill instance's log says nothing about it.

# %%
import re
from pathlib import Path

decode_log = next(i.log_path for i in dep.instances if i.spec.role == "decode")
log_lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in Path(decode_log).read_text().splitlines()]
handshake = [n for n, line in enumerate(log_lines) if "NIXL compatibility check passed" in line]
plan_line = next(line for line in log_lines if "Transfer plan:" in line)
print(decode_log)
print("\n".join(log_lines[n] for n in handshake))
print(plan_line)
block_len = int(re.search(r"remote_block_len=(\d+)", plan_line).group(1))
first_scrape = next(n for n, line in enumerate(log_lines) if "GET /metrics" in line)  # section 6's `before`
assert len(handshake) == 1 and handshake[0] < first_scrape
assert block_len * shape.num_layers == 128 * shape.kv_bytes_per_token()
prefill_log = next(i.log_path for i in dep.instances if i.spec.role == "prefill")
assert "compatibility check" not in Path(prefill_log).read_text()
