"""Initialises after to_empty with each module's own reset_parameters, as a generic recipe
does: torch's default initialisation from the global generator, not the GPT's seeded one."""

TASK = "task5_8"
EXPECT = r"differ from GPT\(config, seed\)'s .*not a module's own reset_parameters"
REPLACE = {"build_sharded": [
    ("    # The eager build's draws, each whole on every rank; each rank keeps its own rows.\n"
     "    model.init_weights(torch.Generator().manual_seed(seed))\n",
     "    torch.manual_seed(seed)\n"
     "    for module in model.modules():\n"
     "        if hasattr(module, \"reset_parameters\"):\n"
     "            module.reset_parameters()\n"),
]}
