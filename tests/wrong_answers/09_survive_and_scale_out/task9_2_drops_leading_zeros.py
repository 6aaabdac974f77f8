"""Expands the ranges with int() and str() alone: node[01-03] becomes node1, node2, node3,
hosts that do not exist."""

TASK = "task9_2"
EXPECT = r"expand_nodelist\('node\[01-03\]'\) gave \['node1'"


def expand_nodelist(nodelist: str) -> list[str]:
    def expand(host: str) -> list[str]:  # the first bracket, then the rest of the name
        match = re.search(r"\[([^\]]*)\]", host)
        if not match:
            if not host or "]" in host:
                raise ValueError(f"bad host {host!r} in node list {nodelist!r}")
            return [host]
        head, tail = host[:match.start()], host[match.end():]
        numbers = []
        for part in match.group(1).split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise ValueError(f"bad range {part!r} in node list {nodelist!r}")
            if high and int(high) < int(low):
                raise ValueError(f"range {part!r} runs backwards in node list {nodelist!r}")
            numbers += [str(n) for n in range(int(low), int(high or low) + 1)]  # widths lost
        rests = expand(tail) if tail else [""]  # the brackets further right
        return [head + number + rest for number in numbers for rest in rests]

    if not nodelist.strip():
        raise ValueError("the node list is empty")
    hosts, depth, begin = [], 0, 0
    for i, char in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced brackets in node list {nodelist!r}")
        if char == "," and depth == 0:
            hosts += expand(nodelist[begin:i].strip())
            begin = i + 1
    if depth:
        raise ValueError(f"unclosed bracket in node list {nodelist!r}")
    return hosts
