"""The flows that chain the stages: `iterate` (generate → score → curate → train → export →
evaluate, with μ_i = π_{i−1}) and `quickstart` (the whole flow on a CPU in minutes). The top of
the library: each composes the packages below it; only the commands import it.
"""
