"""The operator's toolbox: the ``ib`` command line (cli puts together commands/, one
module per command group), what the commands share (console), and what they start on
this host (local/: the embedded broker, worker and gateway processes, the engines' own
servers, a whole local fleet for `ib up`; flower/; the demo; profiles/: the profile
benchmark). It sits on top: it may import workers, gateway, dispatcher and core; none
of them imports it."""
