"""Engine.step: the scheduler, the lanes (exact loop, batch), requests and admission."""
