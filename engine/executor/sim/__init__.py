"""What the simulated executor needs: model shapes without weights, hardware, and the cost model."""
