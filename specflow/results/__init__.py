"""A run's results: what is recorded, where it is written, and how runs are compared.

- ``records``: the schema (per-request record, run summary), the only module that knows the
  JSON keys;
- ``run_folder``: the run folder written as results are produced (``requests.jsonl``,
  ``summary.json``), read back for ``resume=true``;
- ``measure``: a request's measurements from its generations;
- ``metrics``: the slash-separated metric names every logger uses;
- ``compare`` (``python -m specflow.results.compare``): finished runs side by side;
- ``paired``: methods decoded side by side over the same requests, against a reference;
- ``oracle`` (``python -m specflow.results.oracle``): MetaSD's best single drafter in hindsight;
- ``baselines``: plain-decoding baselines kept on disk, and the machine they ran on.
"""
