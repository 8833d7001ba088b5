"""Shell scripts for GPU hosts without Kubernetes: one `vllm serve` per replica host, and the pdlab router.

Hosts are named `<endpoint>-prefill-<i>` and `<endpoint>-decode-<i>`; make those names resolve (DNS or
/etc/hosts) on every host. Copy the rendered folder to every host and run the role's script there."""

from __future__ import annotations

import shlex

from pdlab.cluster.plan import ClusterPlan, RolePlan
from pdlab.cluster.text import to_yaml

HEADER = ("#!/usr/bin/env bash\n"
          "# Rendered by `pdlab cluster render --target script`; edit the lab spec, not this file.\n"
          "set -euo pipefail\nhere=\"$(cd \"$(dirname \"$0\")\" && pwd)\"\n")
#: Marks where the script's own folder goes in an argv, so it is written as "$here/..." rather than quoted away.
HERE = "@HERE@"


def command_lines(argv: list[str]) -> str:
    """`exec` of argv, one flag (with its value) per line, so the script reads like the spec."""
    groups: list[list[str]] = []
    for arg in argv:
        last = groups[-1] if groups else None
        flag_wants_value = last is not None and last[0].startswith("--") and len(last) == 1
        leading_words = last is not None and not last[0].startswith("--")
        if last is not None and not arg.startswith("--") and (flag_wants_value or leading_words):
            last.append(arg)
        else:
            groups.append([arg])
    text = " \\\n    ".join(" ".join(_quote(a) for a in g) for g in groups)
    return f"exec {text}\n"


def _quote(arg: str) -> str:
    if arg.startswith(HERE):
        return '"$here' + arg[len(HERE):] + '"'
    quoted = shlex.quote(arg)
    if quoted != arg and "'" in arg and not set('"$`\\!') & set(arg):
        return f'"{arg}"'  # Python code with quotes reads better in double quotes, and means the same here
    return quoted


def role_script(plan: ClusterPlan, role: RolePlan) -> str:
    lines = [HEADER, f"# {role.role} replica: run on each of {', '.join(plan.replica_names(role))} "
                     f"(GPUs: {role.pool.gpus}, EFA interfaces: {role.pool.efa_interfaces}).\n"]
    lines += [f"export {k}={shlex.quote(v)}\n" for k, v in role.env.items() if k != "LMCACHE_CONFIG_FILE"]
    lines.append(f"export LMCACHE_CONFIG_FILE=\"$here/{role.lmcache_file}\"\n")
    lines.append(": \"${HF_TOKEN?set HF_TOKEN (empty for models that are not gated)}\"\n")
    lines.append(command_lines(["vllm", "serve", plan.model, *plan.shared_args(), *role.role_args,
                                "--host", "0.0.0.0"]))
    return "".join(lines)


def router_script(plan: ClusterPlan) -> str:
    port = plan.cluster.port
    urls = {role.role: [f"http://{name}:{port}" for name in plan.replica_names(role)] for role in plan.roles}
    tokenizer = f"{HERE}/tokenizer"
    fetch = " ".join(_quote(a) for a in plan.tokenizer_download(tokenizer))
    return "".join([
        HEADER, "# The pdlab router: run on a host that reaches every replica (pip install pdlab huggingface_hub).\n",
        "# It counts prompt tokens with the model's tokenizer: fetch the tokenizer files once.\n",
        f"[ -f \"$here/tokenizer/tokenizer.json\" ] || {fetch}\n",
        command_lines(plan.router_argv(prefill_urls=urls["prefill"], decode_urls=urls["decode"],
                                       tokenizer_dir=tokenizer)),
    ])


def render(plan: ClusterPlan) -> dict[str, str]:
    files = {"prefill.sh": role_script(plan, plan.prefill), "decode.sh": role_script(plan, plan.decode),
             "router.sh": router_script(plan)}
    for role in plan.roles:
        files[role.lmcache_file] = to_yaml(role.lmcache)
    return files
