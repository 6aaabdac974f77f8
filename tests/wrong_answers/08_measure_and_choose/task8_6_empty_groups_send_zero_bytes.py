"""Lists collectives of 0 bytes for a group without parameters: FSDP2 issues none."""

TASK = "task8_6"
EXPECT = r"issues no collective \(not one of 0 bytes\)"
REPLACE = {"fsdp_step_collectives": [
    ("        if not shapes:\n            continue\n", ""),
]}
