"""Step 5 of ``external-cluster.sh``: every query scan's stored matches compared bit for bit
between run A (undisturbed) and run B (a worker killed mid-match); prints PASS or FAIL.

    python compare_matches.py STORE A B WORK ADDR VICTIM VICTIM_PID N_SCANS KIND PROTOCOL NANNY \
        SEC_A SEC_B SEC_KILL N_DONE

Exit 0 on PASS, 1 when the stores differ. :func:`differences` is the comparison itself
(``tests/test_external_recipe.py`` runs it on stores written in the test)."""
from __future__ import annotations

import json
import os
import sys

import numpy as np

from scanforest.tasks.store import ScanStore


def differences(store: str, a_path: str, b_path: str, index: str = "default"):
    """``(queries, bad, rows)``: the query scans of ``store`` (those not in the index ``index``),
    ``(scan id, why)`` for each whose match stage differs between the stores ``a_path`` and
    ``b_path`` (a missing stage, a record field, an array's type, shape or bytes), and the
    query descriptors compared."""
    a, b = ScanStore(a_path, mode="r"), ScanStore(b_path, mode="r")
    st = ScanStore(store, mode="r")
    reference = set(st.catalog.index_attrs(index).get("scans", []))
    queries = [s for s in st.scans() if s not in reference]
    bad, rows = [], 0
    for sid in queries:
        why = []
        for name, s in (("A", a), ("B", b)):
            if not s.has_stage(sid, "match"):
                why.append(f"no match stored by run {name}")
        if not why:
            ra, rb = a.stage(sid, "match"), b.stage(sid, "match")
            for key in ("index", "content_hash", "k", "queries"):
                if ra.get(key) != rb.get(key):
                    why.append(f"record {key}: {ra.get(key)!r} != {rb.get(key)!r}")
            for arr in ("match_ids", "match_dist"):
                x, y = a.read(sid, arr), b.read(sid, arr)
                if x.dtype != y.dtype or x.shape != y.shape:
                    why.append(f"{arr}: {x.dtype}{x.shape} != {y.dtype}{y.shape}")
                elif x.tobytes() != y.tobytes():  # bit for bit (NaN and -0.0 included)
                    n = int((x.view(np.uint8).reshape(len(x), -1) != y.view(np.uint8).reshape(len(y), -1))
                            .any(axis=1).sum())
                    why.append(f"{arr}: {n} of {len(x)} rows differ")
            rows += int(ra.get("queries", 0))
        if why:
            bad.append((sid, "; ".join(why)))
    return queries, bad, rows


def _cluster_after(addr: str, victim: str) -> str:
    """The cluster after run B: the Nanny's fresh worker, or one worker fewer without a Nanny."""
    try:
        from distributed import Client

        with Client(addr, timeout="10s") as c:
            ws = c.scheduler_info(n_workers=-1)["workers"]
            names = {w["name"]: ad for ad, w in ws.items()}
            pids = c.run(os.getpid)
            if victim in names:
                return f"; {victim} came back as pid {pids.get(names[victim], '?')} ({len(ws)} workers now)"
            return f"; {victim} stayed gone ({len(ws)} worker{'s' if len(ws) != 1 else ''} left)"
    except Exception as exc:  # the verdict does not depend on it
        return f"; the cluster could not be asked afterwards ({type(exc).__name__})"


def main(argv: list[str]) -> int:
    (store, a_path, b_path, work, addr, victim, victim_pid, n_scans, kind, protocol, nanny,
     sec_a, sec_b, sec_kill, n_done) = argv
    queries, bad, rows = differences(store, a_path, b_path)
    runs = {name: json.load(open(os.path.join(work, f"match-{name}.json"))) for name in ("a", "b")}
    after = _cluster_after(addr, victim)
    for name in ("a", "b"):
        r = runs[name]
        if r.get("matched") != len(queries):
            bad.append((f"run {name.upper()}", f"summary says {r.get('matched')} of {len(queries)} scans matched"))
    if bad or len(queries) != int(n_scans):
        print(f"FAIL: the two runs' stored matches differ ({len(bad)} of {len(queries)} query scans):")
        for sid, why in bad:
            print(f"  {sid}: {why}")
        if len(queries) != int(n_scans):
            print(f"  the store holds {len(queries)} query scans, not the {n_scans} scenes written")
        return 1
    print(f"PASS: {len(queries)} scans matched ({rows:,} descriptors, k={runs['a'].get('k')}, "
          f"{runs['a'].get('shards')} shards on {runs['a'].get('workers')} {kind} workers over {protocol}) "
          f"with identical stored matches: run A undisturbed {sec_a} s, run B {sec_b} s with worker {victim} "
          f"(pid {victim_pid}{', under its Nanny' if nanny == '1' else ', no Nanny'}) SIGKILLed at +{sec_kill} s, "
          f"when {n_done} of {n_scans} scans had matches written{after}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
