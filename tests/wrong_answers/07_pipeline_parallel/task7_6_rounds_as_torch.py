"""Copies torch's check that m goes in max(1, m // p) equal rounds, which only its interleaved
form needs: 9 micro-batches on 4 stages are refused."""

TASK = "task7_6"
EXPECT = r"with one stage per rank there are no rounds to fill"
REPLACE = {"zero_bubble": [("    stages = []\n",
                            "    if num_micro_batches % max(1, num_micro_batches // num_stages):\n"
                            "        raise ValueError('m does not go in equal rounds')\n"
                            "    stages = []\n")]}
