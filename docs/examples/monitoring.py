import threading
import urllib.request

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import set_meter_provider
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import start_http_server

import bucketimer
import bucketimer.otel

# The application's OpenTelemetry setup: an SDK MeterProvider whose reader
# serves Prometheus text over HTTP (port 0: any free one).
server, _ = start_http_server(0, addr="127.0.0.1")
set_meter_provider(MeterProvider(metric_readers=[PrometheusMetricReader()]))

# bucketimer's instruments on that provider: the default TimerThread's
# counters and lateness, and the gRPC interceptors' reports.
bucketimer.otel.instrument()

ran = threading.Event()
bucketimer.call_later(0.01, ran.set)
bucketimer.call_later(60, print, "never printed").cancel()
ran.wait()

# What a Prometheus server scraping this process reads.
url = f"http://127.0.0.1:{server.server_port}/metrics"
with urllib.request.urlopen(url) as response:
    for line in response.read().decode().splitlines():
        if line.startswith(("bucketimer_timers_scheduled", "bucketimer_timers_fired",
                            "bucketimer_timers_cancelled")):
            name, value = line.split("{")[0], line.rsplit(" ", 1)[1]
            print(name, value)
server.shutdown()
