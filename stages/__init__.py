"""The stages a pipeline is composed of, one package per role and one module per stage:
``drafters/``, ``verifiers/``, ``acceptors/``, ``selectors/``, ``draft_length/``.  Each
satisfies its role's protocol in ``specflow.protocols`` and is chosen by config
(``_target_``); a stage imports ``specflow`` and its own role's package only."""
