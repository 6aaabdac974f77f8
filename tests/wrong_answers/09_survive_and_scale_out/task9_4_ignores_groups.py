"""Takes every rank as a member of every group: a rank outside a subgroup is reported as
having missed its collectives."""

TASK = "task9_4"
EXPECT = r"rank 2 is not missing its collectives|rank 2 is a member of group '1'"
REPLACE = {"first_mismatch": [
    ('        members = (groups or {}).get(name, list(records))',
     '        members = list(records)'),
]}
