"""The operator's toolbox: the ``ib`` command line (cli and one module per command group),
what the commands share (console), and what they start on this host: the embedded
broker, worker processes, Flower, a whole local fleet (`ib up`), the demo, and the
profile benchmark. It sits on top: it may import workers and dispatcher; neither imports it."""
