"""The training-free token-tree drafter (``drafter.TokenTreeDrafter``) and what only it
uses: the suffix index, the recycling table, the tree's plan and calibration, and the
tables kept across runs."""
