"""The plan's outputs: the summary rows (the CSV), the Markdown plan with every term and its formula, and what
does not fit (each job's failures and the disk of all jobs)."""
from __future__ import annotations

from memopd.config import plan_config
from memopd.plan.jobs import Job
from memopd.plan.models import GB


def disk_need(jobs: list[Job]) -> float:
    return sum(v for j in jobs for v, _ in j.disk.values())


def failures(cfg: dict, jobs: list[Job]) -> list[str]:
    out = [f for j in jobs for f in j.failures()]
    disk, limit = disk_need(jobs), plan_config(cfg).disk_gb * GB
    if disk > limit:
        out.append(f"disk: results + data need {disk / GB:.0f} GB > plan.disk_gb {limit / GB:.0f}")
    return out


def rows(jobs: list[Job]) -> list[dict]:
    out = []
    for j in jobs:
        phase, gpu = j.peak()
        out.append({"job": j.name, "gpus": j.gpus, "peak_phase": phase,
                    "gpu_gb": round(gpu / GB, 1) if j.gpus else "", "gpu_limit_gb": round(j.gpu_limit / GB) if j.gpus else "",
                    "gpu_headroom_gb": round((j.gpu_limit - gpu) / GB, 1) if j.gpus else "",
                    "host_gb": round(j.host_peak() / GB, 1), "host_limit_gb": round(j.mem_limit / GB, 1),
                    "disk_gb": round(sum(v for v, _ in j.disk.values()) / GB, 1), "fits": not j.failures()})
    return out


def _phase_terms(j: Job, peak: str) -> list[tuple]:
    """The peak phase's terms, then each other phase's terms not listed yet (a term of the same name and size)."""
    where, seen, out = "GPU" if j.gpus else "RAM", set(), []
    for ph in [peak] + [p for p in j.phases if p != peak]:
        for k, v in j.phases.get(ph, {}).items():
            if (k, v[0]) not in seen:
                seen.add((k, v[0]))
                out.append((f"{where} {ph}", k, v))
    return out


def markdown(cfg: dict, jobs: list[Job]) -> str:
    r = rows(jobs)
    keys = list(r[0]) if r else []
    lines = [f"Resource plan ({cfg.get('scale', '?')} scale; GB = 1e9 B; GPU figures per GPU, host per job)", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(x[k]) for k in keys) + " |" for x in r]
    lines += ["", f"disk (all jobs): {disk_need(jobs) / GB:.0f} GB of plan.disk_gb {plan_config(cfg).disk_gb}", ""]
    for j in jobs:
        phase = j.peak()[0]
        totals = ", ".join(f"{ph} {sum(v for v, _ in t.values()) / GB:.1f}" for ph, t in j.phases.items())
        lines += [f"### {j.name}", "", f"{j.gpus} GPU(s); GB per {'GPU' if j.gpus else 'job'} by phase: {totals or '-'}",
                  "", "| where | term | GB | formula |", "|---|---|---|---|"]
        terms = _phase_terms(j, phase) + [("host", k, v) for k, v in j.host.items()]
        terms += [(f"host {ph}", k, v) for ph, t in j.host_phases.items() for k, v in t.items()]
        terms += [("disk", k, v) for k, v in j.disk.items()]
        lines += [f"| {w} | {k} | {v / GB:.2f} | {f} |" for w, k, (v, f) in terms]
        lines += [f"| check | {what} | {need / GB:.2f} | <= {lim / GB:.1f} |" for what, need, lim in j.checks] + [""]
    return "\n".join(lines)
