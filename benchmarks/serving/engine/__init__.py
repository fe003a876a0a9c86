"""Throughput and latency of this engine against plain transformers, on the same model and prompts.

Systems (each in its own subprocess, so peak RSS is per system and no two run at once), named
``KIND`` or ``KIND:DTYPE`` with ``DTYPE`` one of ``float32`` and ``bfloat16`` (``fp32``, ``bf16``):

* ``engine``: :class:`inference.engine.llm_engine.LLMEngine` over the transformers backend,
  in-process, ticked synchronously on the main thread (no web tier); plain ``engine`` is
  ``dtype="auto"``, what a user gets by default (the run prints what it resolved to),
  ``engine:float32`` forces it;
* ``generate:DTYPE``: ``model.generate`` with static batching at the same batch size (what a user
  would write instead), the model loaded with ``from_pretrained(..., dtype=DTYPE)``: each batch
  is padded to its longest prompt and runs to its longest answer;
* ``generate_batch:DTYPE``: transformers' own continuous batching manager (the engine behind
  ``model.generate_batch``), fed by the same closed-loop client;
* ``llama_server:bfloat16`` and ``llama_server:q4_1``: llama.cpp's ``llama-server`` on the
  default model's bf16 GGUF and on its wheel's Q4_1 GGUF, one slot per request in flight and a
  thread per core, fed the same token ids by the same closed-loop client through its OpenAI
  endpoint (:mod:`.llama`; built by ``scripts/llama_cpp.sh``, part of the default set where
  built, else left out with a line saying why).

A peer named without a dtype is its ``float32`` run. The default set is ``engine`` and both
peers in both dtypes (:data:`DEFAULT_SYSTEMS`). Each engine row's throughput is compared with
``generate`` and ``generate_batch`` in the dtype the engine ran in, and with ``generate:float32``
(``from_pretrained``'s default on the default model folder); a summary of the targets
(:data:`TARGETS`) ends the table, printed only (PASS or MISS, never asserted); the targets
against llama.cpp's bf16 GGUF hold for a bf16 engine on a CPU with AVX512-BF16 and are
``report`` elsewhere. For workload c, the weight bytes each system's decode step reads over its
ITL p50 (GB/s) are printed against the machine's read bandwidth measured in the same run.

Workloads (greedy; every request generates exactly its ``max_tokens``: EOS is ignored):

* ``a``: fixed lengths: 32 requests of 40 prompt tokens, 64 new tokens, 32 at a time;
* ``b``: mixed: 64 requests, prompts of 16 to 384 tokens, ``max_tokens`` 16 to 192, 32 at a time;
* ``c``: batch 1: requests of 40 prompt tokens and 64 new tokens, one at a time.

A closed-loop client keeps ``concurrency`` requests in flight: a new one is submitted as soon as
one finishes. TTFT is from a request's submission to its first token; ITL is the gap between a
request's consecutive tokens (seconds). Output tokens/s counts the tokens requested, not padding.

Repeats: engine rows run ``--repeats`` times on every workload (3; 1 with ``--quick``), the
peers ``--peer-repeats`` times on a and c (2; 1 with ``--quick``) and once on b, where one run
takes minutes. Medians over the runs.

Usage::

    python -m benchmarks.serving.engine            # full, 5 systems: ~27 min on 2 cores
    python -m benchmarks.serving.engine --quick    # smaller workloads, 1 repeat: ~7 min
    python -m benchmarks.serving.engine --systems engine,engine:float32,generate:float32

The durations are estimates from the fp32 systems' speeds (the earlier 3-system run took 18 min):
workload b's single runs of the four peers take about 13 of the 27 minutes. On a CPU without
native bf16 (no AVX512_BF16 or AMX) the bf16 peers run slower and the run takes longer.

The table is printed and saved as JSON under ``benchmarks/results/``.

Its parts: :mod:`.systems` (the systems' names), :mod:`.workloads` (the requests and the
measurement of one run), :mod:`.worker` (what runs in each system's process: the engine, generate
and generate_batch fed by the closed-loop client), :mod:`.report` (ratios, targets, the table and
the JSON) and :mod:`.cli` (the command line, which starts one worker process per run:
``python -m benchmarks.serving.engine --worker SYSTEM ...``).
"""
