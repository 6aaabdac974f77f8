"""Serves the capacity token by token: a token's second choice takes a place before the next
token's first choice, so a popular expert turns first choices away."""

TASK = "task11_1"
EXPECT = r"token by token"
REPLACE = {"route": [
    ("    choice_major = experts.t().reshape(-1)  # every first choice, then every second, ...\n",
     "    choice_major = experts.reshape(-1)  # token 0's choices, then token 1's, ...\n"),
    ("    kept = (place < capacity).reshape(k, num_tokens).t()\n",
     "    kept = (place < capacity).reshape(num_tokens, k)\n"),
]}
