"""What ``ib`` starts on this host: the embedded broker, worker and gateway processes,
the engines' own servers (the peers benchmarks compare against) and a whole local
fleet (`ib up`)."""
