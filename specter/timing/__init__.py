"""What a run is timed by: the wall and virtual clocks, the virtual clock's cost model, and the
profiles of real GPUs, links, hosts and models that the cost model and the links are set from."""
