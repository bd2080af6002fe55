"""Run-time utilities below everything else: progress and the hang watchdog, host memory, durable file I/O, HTTP calls, the program sandbox."""
