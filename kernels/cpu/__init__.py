"""C++ CPU kernels (*.cpp, as torch ops under torch.ops.workbench_cpu), built once per machine by build.py;
where no compiler is at hand the engine runs the torch references in kernels.reference instead."""
