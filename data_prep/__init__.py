"""Readers for the official LRA release, local generators, and tiny-split makers.

Every task is prepared in two steps: a *source* in the official release format (downloaded, or
generated here for the synthetic tasks) and a *reader* that turns that source into the prepared
cache (`lra_cond.data.cache`). The same reader serves the real release and our generators.
"""
