"""Sends the same 8 concurrent greedy chat requests to two servers; prints whether every reply
is identical (batched GEMV variants must give bitwise-equal decodes)."""
import concurrent.futures as cf, json, sys, urllib.request

def ask(port, i):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"Tell me about item {i} please"}],
                       "max_tokens": 48, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["message"]["content"]

for port_a, port_b in [(int(sys.argv[1]), int(sys.argv[2]))]:
    with cf.ThreadPoolExecutor(8) as ex:
        a = list(ex.map(lambda i: ask(port_a, i), range(8)))
    with cf.ThreadPoolExecutor(8) as ex:
        b = list(ex.map(lambda i: ask(port_b, i), range(8)))
    same = sum(x == y for x, y in zip(a, b))
    print(f"identical replies: {same}/8", "(lengths", [len(x) for x in a], ")")
