"""Test helpers for llmgw users and plugin authors: hardware fakes that behave like the real thing.

- :func:`write_fake_nvidia_smi`, :func:`make_gpus`: an ``nvidia-smi`` script
  that answers discovery's query like the real one (or fails like it).
- :func:`write_ib_sysfs`, :func:`make_adapters`: a sysfs-shaped InfiniBand tree.
- :mod:`llmgw.testing.contract`: ``EngineContract``, the conformance suite an
  engine distribution's tests subclass (needs pytest).
- :mod:`llmgw.testing.pytest_plugin`: fixtures engine distributions share
  (``engine_help_dir``), loaded by pytest wherever llmgw is installed.
- :mod:`llmgw.testing.processes`: run processes in tests and always end their
  whole process group; wait on conditions with deadlines (needs pytest).
- :mod:`llmgw.testing.clock`: :class:`~llmgw.testing.clock.FakeClock`, seconds that move only when
  the test says, for code that takes a ``clock`` callable.
- :mod:`llmgw.testing.lora`: :func:`~llmgw.testing.lora.make_sim_adapter`, a
  small PEFT LoRA adapter directory (``llmgw-sim --enable-lora`` loads it).
- :mod:`llmgw.testing.stepped`: :class:`~llmgw.testing.stepped.SteppedFleet`, simulated nodes
  syncing with a cluster state in the test's process, on the test's clock.
- :mod:`llmgw.testing.chat`: :func:`~llmgw.testing.chat.chat_body`, the chat completion request
  tests and benchmarks send.
- :mod:`llmgw.testing.sse_backend`: the bytes of a chunked event stream, for fake engines on asyncio.
- :mod:`llmgw.testing.llamacpp`: the llama.cpp build end-to-end tests run (or skip without).
"""

from __future__ import annotations

from llmgw.testing.fakes import make_adapters, make_gpus, write_fake_nvidia_smi, write_ib_sysfs

__all__ = ["make_adapters", "make_gpus", "write_fake_nvidia_smi", "write_ib_sysfs"]
