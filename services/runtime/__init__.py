"""What every process of a stack runs on, below all the services: the service main loop (process), the host's
torch.distributed store (store) and the registry of stacks running on this machine (stacks, stackfile)."""
