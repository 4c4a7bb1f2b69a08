"""jpipe against torch.distributed.pipelining on the same model, weights, batch and micro-batches.

Run ``python -m experiments.compare_torch --pipe 4 --microbatches 8`` (needs
``pip install ".[compare]"``, i.e. ``torch==2.13.0``) to write ``REPORT.md``
and a PNG comparing, per schedule pair (GPipe, 1F1B, interleaved 1F1B, ZB-H1):
the executed action order per device, gradients after one step, peak held
micro-batches, step time and peak RSS, and the simulated bubble of both tables.

Modules: :mod:`.spec` (plain data: model spec, schedule pairs, run config,
order helpers), :mod:`.jax_models` (the jpipe models), :mod:`.torch_models`
(the torch models and the parameter conversion), :mod:`.jpipe_worker` and
:mod:`.torch_worker` (the two sides, each in bounded subprocesses),
:mod:`.compare` (the driver) and :mod:`.report` (markdown and figure).
"""
