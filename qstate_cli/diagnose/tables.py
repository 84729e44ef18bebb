"""Terminal views of a diagnose document: the ranked summary and the profile."""
from __future__ import annotations


def summary_rows(doc: dict) -> list[dict]:
    """One row per configuration (records are per configuration and state), by rank."""
    by_cfg: dict[str, dict] = {}
    for r in doc["records"]:
        row = by_cfg.setdefault(r["config"], {
            "rank": r["rank"], "config": r["config"], "bytes_per_param": r["bytes_per_param"],
            "update_cosine": r["update_cosine"], "update_rel_error": r["update_rel_error"],
            "reset_period": r["reset_period"], "reset_reason": r["reset_reason"]})
        s = r["state"]
        row[f"drift_{s}"] = r["drift_mean"]
        row[f"rel_rms_{s}"] = r["rel_rms_error"]
        row[f"stall_{s}"] = r["stall_rate"]
        row[f"cstall_{s}"] = r.get("code_stall_rate")
        row[f"clate_{s}"] = r.get("code_stall_rate_late")
        # the models predict value stalls; beside BReD's code stalls (its value moves every step, its
        # code need not) their 0% read as a miss: the table leaves them out (the records keep them)
        if r.get("stall_rate_predicted_late") is not None and r.get("rounding") != "bred":
            row[f"pred_{s}"] = r["stall_rate_predicted_late"]
        if r.get("stall_rate_predicted_empirical_late") is not None and r.get("rounding") != "bred":
            row[f"emp_{s}"] = r["stall_rate_predicted_empirical_late"]
        row[f"stale90_{s}"] = r["staleness_p90"]
        row[f"slope_{s}"] = r["dim_slope"]
    return sorted(by_cfg.values(), key=lambda r: r["rank"])


def summary_columns(rows: list[dict]):
    states = [s for s in ("m", "v") if any(f"drift_{s}" in r for r in rows)]
    cols = ["rank", "config", "bytes_per_param", "update_cosine", "update_rel_error"]
    for s in states:
        cols += [f"drift_{s}", f"rel_rms_{s}", f"stall_{s}", f"cstall_{s}"]
        if s == states[-1]:  # the slowest state: where stalling, staleness and dimension scaling tell most
            cols.append(f"clate_{s}")
        if s == states[-1]:
            cols += [c for c in (f"pred_{s}", f"emp_{s}") if any(c in r for r in rows)]
            cols += [f"stale90_{s}", f"slope_{s}"]
    cols.append("reset_period")
    pct = lambda v: f"{v:.1%}"
    fmts = {"bytes_per_param": ".4f", "update_cosine": ".4f", "update_rel_error": ".3g"}
    heads = {"bytes_per_param": "B/param", "update_cosine": "upd cos", "update_rel_error": "upd err",
             "reset_period": "reset"}
    for s in states:
        fmts.update({f"drift_{s}": "+.2e", f"rel_rms_{s}": ".3g", f"stall_{s}": pct, f"pred_{s}": pct,
                     f"slope_{s}": ".2f", f"cstall_{s}": pct, f"clate_{s}": pct, f"emp_{s}": pct})
        heads.update({f"drift_{s}": f"drift {s}", f"rel_rms_{s}": f"rms err {s}", f"stall_{s}": f"stall {s}",
                      f"cstall_{s}": f"code stall {s}", f"clate_{s}": f"code late {s}",
                      f"emp_{s}": f"emp late {s}",
                      f"pred_{s}": f"gauss late {s}", f"stale90_{s}": f"stale p90 {s}", f"slope_{s}": f"d-slope {s}"})
    return cols, fmts, heads


def profile_rows(prof: dict) -> tuple[list[dict], str]:
    """Per phase: seconds and element-steps per second (recorded elements x steps / s), the
    seconds a first use spent compiling kernels in it, this process loading them from the
    disk cache and the first call's other one-time work (a column each, only when there were
    any) left out of the rate."""
    es = prof["element_steps"]
    compiled = prof.get("phases_compile_s") or {}
    loaded = prof.get("phases_load_s") or {}
    setup = prof.get("phases_setup_s") or {}
    rows = []
    for phase, sec in prof["phases_s"].items():
        net = sec - compiled.get(phase, 0.0) - loaded.get(phase, 0.0) - setup.get(phase, 0.0)
        row = {"phase": phase, "seconds": sec}
        if compiled:
            row["compiling_s"] = compiled.get(phase, 0.0)
        if loaded:
            row["loading_s"] = loaded.get(phase, 0.0)
        if setup:
            row["first_step_setup_s"] = setup.get(phase, 0.0)
        row["M_element_steps_per_s"] = (es / net / 1e6) if net > 0 and phase not in ("gather", "shadow") else None
        rows.append(row)
    rate, cpu_rate = prof["element_steps_per_s_per_config"], prof.get("element_steps_per_cpu_s_per_config")
    title = (f"Replay profile on {prof['device']} ({prof.get('threads')} CPU threads, "
             f"{prof.get('config_threads', 1)} configuration threads): {es / 1e6:.1f} M element-steps "
             f"x {prof['configs']} configurations in {prof['replay_s']:.2f} s = {(rate or 0) / 1e6:.2f} M "
             f"element-steps/s per configuration ({(cpu_rate or 0) / 1e6:.2f} M per CPU-second)")
    if prof.get("compile_s"):
        title += (f"; {prof['compile_s']:.1f} s compiling the CPU kernels (first use on this machine, "
                  "cached for later runs) left out")
    if prof.get("load_s"):
        title += f"; {prof['load_s']:.2f} s loading the CPU kernels from the cache (once per process) left out"
    if prof.get("setup_s"):
        title += (f"; {prof['setup_s']:.3f} s of one-time work in the first step (imports, probes, "
                  "starting threads) left out")
    return rows, title
