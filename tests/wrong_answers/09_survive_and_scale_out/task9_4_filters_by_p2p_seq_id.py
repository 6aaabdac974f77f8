"""Tells sends and receives by a non-zero p2p_seq_id: every entry after a rank's first send
carries one, collectives too, so the rest of that rank's collectives are skipped."""

TASK = "task9_4"
EXPECT = r"sends and receives, numbered"


def first_mismatch(records: dict[int, list[dict]],
                   groups: dict[str, list[int]] | None = None) -> dict | None:
    calls: dict[str, dict[int, dict[int, tuple]]] = {}  # group -> rank -> seq id -> call
    for rank, entries in records.items():
        for entry in entries:
            if entry["p2p_seq_id"]:  # a send or a receive
                continue
            seq = entry["collective_seq_id"]
            call = (entry["profiling_name"], tuple(tuple(size) for size in entry["input_sizes"]))
            calls.setdefault(entry["process_group"][0], {}).setdefault(rank, {}).setdefault(
                seq, call)
    found = []
    for name, by_rank in calls.items():
        members = (groups or {}).get(name, list(records))
        for seq in sorted({seq for recorded in by_rank.values() for seq in recorded}):
            seen = {}
            for rank in members:
                recorded = by_rank.get(rank, {})
                if recorded and seq < min(recorded):
                    continue  # dropped from this rank's buffer: unknown
                seen[rank] = recorded.get(seq)
            if len(set(seen.values())) > 1:
                found.append((seq, name, seen))
                break
    if not found:
        return None
    seq, name, seen = min(found, key=lambda item: (item[0], item[1]))
    return {"process_group": name, "seq_id": seq, "calls": seen}
