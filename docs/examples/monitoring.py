import threading
import urllib.request

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import set_meter_provider
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import start_http_server

import bucketimer
import bucketimer.otel
import bucketimer.prometheus

# The application's OpenTelemetry setup: an SDK MeterProvider whose reader
# serves Prometheus text over HTTP (port 0: any free one).
server, _ = start_http_server(0, addr="127.0.0.1")
set_meter_provider(MeterProvider(metric_readers=[PrometheusMetricReader()]))

# bucketimer's instruments on that provider: the default TimerThread's
# counters, and the gRPC interceptors' reports; and the timers' lateness,
# a Prometheus histogram, on the same registry.
bucketimer.otel.instrument()
bucketimer.prometheus.register()

ran = threading.Event()
bucketimer.call_later(0.01, ran.set)
bucketimer.call_later(60, print, "never printed").cancel()
ran.wait()

# What a Prometheus server scraping this process reads.
url = f"http://127.0.0.1:{server.server_port}/metrics"
with urllib.request.urlopen(url) as response:
    for line in response.read().decode().splitlines():
        if line.startswith(("bucketimer_timer_scheduled", "bucketimer_timer_fired",
                            "bucketimer_timer_cancelled", "bucketimer_timer_lateness_seconds_count",
                            "# TYPE bucketimer_timer_lateness")):
            print(line if line.startswith("#") else f"{line.split('{')[0]} {line.rsplit(' ', 1)[1]}")
server.shutdown()
