-- wrk script: POST /v1/chat/completions with a ~200 B JSON body, API keys round-robin.
--
-- Environment:
--   BENCH_MODEL        model in the body (default "chat")
--   BENCH_KEYS         number of keys sk-bench-0000 .. (default 1000)
--   BENCH_STREAM       "1": "stream":true plus x-demo-interval-ms / x-demo-events
--   BENCH_USAGE        "1" (with BENCH_STREAM): "stream_options":{"include_usage":true}
--   BENCH_EVENTS       x-demo-events (default 50)
--   BENCH_INTERVAL_MS  x-demo-interval-ms (default 1)
--
-- done() prints one line "WRKJSON {...}" with the request count, the error
-- counts (connect, read, write, timeout, and status >= 400) and latency
-- percentiles in microseconds. The body text matches bench/_http.py.

local reqs = {}
local n = 0
local i = 0

function init(args)
  local model = os.getenv("BENCH_MODEL") or "chat"
  local keys = tonumber(os.getenv("BENCH_KEYS") or "1000")
  local stream = os.getenv("BENCH_STREAM") == "1"
  local body = '{"model":"' .. model .. '","messages":[{"role":"system","content":"You are a helpful assistant."},'
    .. '{"role":"user","content":"Say hello in three words, please."}],"max_tokens":64,"temperature":0.2'
  if stream then
    body = body .. ',"stream":true'
    if os.getenv("BENCH_USAGE") == "1" then
      body = body .. ',"stream_options":{"include_usage":true}'
    end
  end
  body = body .. '}'
  local headers = {}
  headers["Content-Type"] = "application/json"
  if stream then
    headers["x-demo-interval-ms"] = os.getenv("BENCH_INTERVAL_MS") or "1"
    headers["x-demo-events"] = os.getenv("BENCH_EVENTS") or "50"
  end
  if keys < 1 then
    keys = 1
  end
  for k = 0, keys - 1 do
    headers["Authorization"] = string.format("Bearer sk-bench-%04d", k)
    reqs[k + 1] = wrk.format("POST", "/v1/chat/completions", headers, body)
  end
  n = keys
  i = 0
end

function request()
  i = i % n + 1
  return reqs[i]
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"bytes":%d,"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d,'
      .. '"p50_us":%d,"p90_us":%d,"p99_us":%d,"p999_us":%d,"mean_us":%.1f,"max_us":%d}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9),
    latency.mean, latency.max))
end
