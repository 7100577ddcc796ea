"""pytest plugins for gpufleet's suite: the test tiers (``tiers``) and the heavy fixtures' code
(``stack``: a Temporal dev server, the simulated fleet, the node gateway), imported only by a
test that uses them."""
