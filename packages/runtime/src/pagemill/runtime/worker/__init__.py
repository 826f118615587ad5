"""The worker side of one step: the model runner, its persistent input batch, CUDA graphs and
compilation."""
