-- wrk script of A1 (bench/agents/a1_load.py): POSTs $A1_BODY with the
-- agent's API key, and prints the latency figures (microseconds) as one
-- JSON line when done.
wrk.method = "POST"
wrk.body = os.getenv("A1_BODY")
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. (os.getenv("OPENAI_API_KEY") or "none")

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"mean_us":%.1f,"p50_us":%d,"p90_us":%d,"p99_us":%d,"p999_us":%d,"max_us":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}}\n',
    summary.requests, summary.duration, latency.mean, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9), latency.max,
    e.connect, e.read, e.write, e.status, e.timeout))
end
