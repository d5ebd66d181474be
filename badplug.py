from asyncinfer.schedulers import FIFOScheduler, SchedulerOutput
import time

class Raises(FIFOScheduler):
    api_version = 1
    calls = 0
    def schedule(self):
        out = super().schedule()
        Raises.calls += 1
        if Raises.calls > 30:
            raise KeyError("budget")
        return out

class Nonsense(FIFOScheduler):
    api_version = 1
    def schedule(self):
        out = super().schedule()
        for rid in list(out.num_scheduled_tokens):
            out.num_scheduled_tokens[rid] += 1000
        return out

class Slow(FIFOScheduler):
    api_version = 1
    def schedule(self):
        time.sleep(0.05)
        return super().schedule()
