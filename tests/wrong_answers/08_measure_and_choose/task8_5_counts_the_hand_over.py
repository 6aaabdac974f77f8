"""Takes every event with "allreduce" in its name for communication: c10d::allreduce_, where the
backward only hands a bucket to gloo, is counted beside gloo:all_reduce, where it runs."""

TASK = "task8_5"
EXPECT = r"c10d::allreduce_ \(it only hands"
REPLACE = {"read_step": [
    ('        kind = next((k for k, prefix in prefixes.items() if event["name"].startswith(prefix)),\n'
     '                    None)\n',
     '        kind = next((k for k, prefix in prefixes.items() if event["name"].startswith(prefix)),\n'
     '                    None)\n'
     '        if "allreduce" in event["name"].replace("_", "").lower():\n'
     '            kind = "comm"\n'),
]}
