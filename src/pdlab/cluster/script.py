"""Shell scripts for GPU hosts without Kubernetes: one `vllm serve` per replica host, and the pdlab router.

Hosts are named `<endpoint>-prefill-<i>` and `<endpoint>-decode-<i>`; make those names resolve (DNS or
/etc/hosts) on the router host. Copy the rendered folder to every host and run the role's script there."""

from __future__ import annotations

import shlex

import yaml

from pdlab.cluster.plan import ClusterPlan, RolePlan, router_command

HEADER = ("#!/usr/bin/env bash\n"
          "# Rendered by `pdlab cluster render --target script`; edit the lab spec, not this file.\n"
          "set -euo pipefail\nhere=\"$(cd \"$(dirname \"$0\")\" && pwd)\"\n")
ROUTER_CONFIG = "router-config.yaml"


def hosts(role: RolePlan) -> list[str]:
    return [f"{role.name}-{i}" for i in range(role.pool.replicas)]


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
    return "exec " + " \\\n    ".join(" ".join(shlex.quote(a) for a in g) for g in groups) + "\n"


def role_script(plan: ClusterPlan, role: RolePlan) -> str:
    lines = [HEADER, f"# {role.role} replica: run on each of {', '.join(hosts(role))} "
                     f"(GPUs: {role.pool.gpus}, EFA interfaces: {role.pool.efa_interfaces}).\n"]
    lines += [f"export {k}={shlex.quote(v)}\n" for k, v in role.env.items() if k != "LMCACHE_CONFIG_FILE"]
    lines.append(f"export LMCACHE_CONFIG_FILE=\"$here/{role.lmcache_file}\"\n")
    lines.append(": \"${HF_TOKEN?set HF_TOKEN (empty for models that are not gated)}\"\n")
    lines.append(command_lines(["vllm", "serve", plan.model, *plan.shared_args(), *role.role_args,
                                "--host", "0.0.0.0"]))
    return "".join(lines)


def router_config(plan: ClusterPlan) -> dict:
    port = plan.cluster.port
    return plan.router_config(prefill_urls=[f"http://{h}:{port}" for h in hosts(plan.prefill)],
                              decode_urls=[f"http://{h}:{port}" for h in hosts(plan.decode)])


def router_script(plan: ClusterPlan) -> str:
    return "".join([HEADER, "# The pdlab router: run on a host that reaches every replica (pip install pdlab).\n",
                    command_lines(router_command(plan, f"$here/{ROUTER_CONFIG}")).replace(
                        shlex.quote(f"$here/{ROUTER_CONFIG}"), f"\"$here/{ROUTER_CONFIG}\"")])


def render(plan: ClusterPlan) -> dict[str, str]:
    files = {"prefill.sh": role_script(plan, plan.prefill), "decode.sh": role_script(plan, plan.decode),
             "router.sh": router_script(plan), ROUTER_CONFIG: yaml.safe_dump(router_config(plan), sort_keys=False)}
    for role in plan.roles:
        files[role.lmcache_file] = yaml.safe_dump(role.lmcache, sort_keys=False)
    return files
