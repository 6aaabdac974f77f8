"""Splits the node list at every comma, brackets or not: "node[01-04,07]" falls apart into
"node[01-04" and "07]"."""

TASK = "task9_2"
EXPECT = r"expand_nodelist\('node\[01-04,07\]'\) gave"


def expand_nodelist(nodelist):
    if not nodelist.strip():
        raise ValueError("the node list is empty")
    hosts = []
    for host in nodelist.split(","):
        match = re.fullmatch(r"(.*)\[(\d+)-(\d+)\](.*)", host)
        if match:
            head, low, high, tail = match.groups()
            hosts += [f"{head}{str(n).zfill(len(low))}{tail}"
                      for n in range(int(low), int(high) + 1)]
        else:
            hosts.append(host)
    return hosts
