"""The optimizers and what runs around their step (docs/optimizers.md).

* build.py        ``build_optimizer`` (AdamW / Muon per ``[optimizer]``) and the once-per-step MoE
                  expert-bias update (``ExpertBiasUpdater``)
* muon.py         ``MuonAdamW``: Muon for the matrices, AdamW for the rest
* muon_owners.py  which rank orthogonalises each matrix (each one once per step)
* qk_clip.py      MuonClip's QK-clip after the step
* engram.py       the Engram tables' CPU-resident optimizer step
* lr_schedule.py  warmup, stable, decay
* ema.py          the parameters' exponential moving average in CPU memory

Nothing is re-exported here: each module is imported by its full name, so importing one does not
build the others (and the import graph in tests/unit/test_house_rules.py stays per module).
"""
