// seams_cpu.cpp: placeholder
