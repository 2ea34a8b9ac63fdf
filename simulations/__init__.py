"""Everything that runs fedgc's parts: simulations, a real deployment, and capture analysis.

- the simulations on Flower's engines: the command line ``python -m simulations
  run|compare|demo|keys|...`` (:mod:`simulations.cli`), scenarios, the runner, results,
  comparisons and plots, the Python API (:mod:`simulations.api`, also ``fedgc.run``), and the
  network emulator (:mod:`simulations.netem`);
- :mod:`simulations.deploy`: a real deployment, Flower's SuperLink and SuperNodes on real
  sockets behind shaped links (``python -m simulations deploy``);
- :mod:`simulations.wire`: packet-capture analysis, where a captured run's bytes go
  (``python -m simulations wire``).
"""
