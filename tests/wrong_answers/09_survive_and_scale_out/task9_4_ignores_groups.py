"""Takes every rank as a member of every group: a rank outside a subgroup is reported as
having missed its collectives."""

TASK = "task9_4"
EXPECT = r"rank 2 is not missing its collectives|rank 2 is a member of group '1'"


def first_mismatch(records: dict[int, list[dict]],
                   groups: dict[str, list[int]] | None = None) -> dict | None:
    calls: dict[str, dict[int, dict[int, tuple]]] = {}  # group -> rank -> seq id -> call
    for rank, entries in records.items():
        for entry in entries:
            operation = entry["profiling_name"].split(":", 1)[-1].split(" ")[0]
            if operation in ("send", "recv"):  # point-to-point: numbered apart
                continue
            seq = entry["collective_seq_id"]
            call = (entry["profiling_name"], tuple(tuple(size) for size in entry["input_sizes"]))
            calls.setdefault(entry["process_group"][0], {}).setdefault(rank, {}).setdefault(
                seq, call)
    found = []
    for name, by_rank in calls.items():
        members = list(records)
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
