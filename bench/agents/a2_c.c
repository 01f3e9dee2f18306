/* A2's compiled agent: the shape of the three-call agent (a call, a
 * streamed call, a call) with nothing to start but itself, so that an
 * exec task's own cost per item shows: a process of a few hundred
 * microseconds against Python's tens of milliseconds. No tool: each call
 * asks the item's question; the last one also carries an answer and asks
 * for the capital alone.
 *
 * Reads the item (JSON) on stdin, takes its "question" (no escapes in
 * it), POSTs to $OPENAI_BASE_URL/chat/completions (http://HOST:PORT/...)
 * with Connection: close, and prints the last answer's "content".
 * `a2_c --startup` exits at once (its start-up, timed alone).
 * Build: cc -O2 -o a2_c a2_c.c */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static char host[256], path[1024];
static int port;

/* One call: the question, and for the last call an answer and the ask for
 * the answer alone (the mock's script then answers the capital). */
static int call(const char *question, int stream, int last, char *out, size_t cap) {
    char body[2048], req[4096];
    int n = snprintf(body, sizeof body,
                     "{\"model\":\"agent-model\",\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}%s],\"stream\":%s}",
                     question,
                     last ? ",{\"role\":\"assistant\",\"content\":\"Looked up.\"},"
                            "{\"role\":\"user\",\"content\":\"Reply with the capital's name alone.\"}"
                          : "",
                     stream ? "true" : "false");
    int m = snprintf(req, sizeof req,
                     "POST %s/chat/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                     "Authorization: Bearer %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
                     path, host, port, getenv("OPENAI_API_KEY") ? getenv("OPENAI_API_KEY") : "", n, body);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, host, &a.sin_addr);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) return -1;
    if (write(fd, req, m) != m) return -1;
    size_t got = 0;
    ssize_t r;
    while (got + 1 < cap && (r = read(fd, out + got, cap - 1 - got)) > 0) got += r;
    out[got] = 0;
    close(fd);
    return strncmp(out, "HTTP/1.1 200", 12) == 0 ? 0 : -1;
}

int main(int argc, char **argv) {
    static char item[65536], buf[1 << 20], question[1024];
    if (argc > 1 && strcmp(argv[1], "--startup") == 0) return 0; /* its start-up alone */
    size_t n = fread(item, 1, sizeof item - 1, stdin);
    item[n] = 0;
    char *q = strstr(item, "\"question\"");
    if (!q || !(q = strchr(q + 10, '"'))) return 2;
    char *end = strchr(q + 1, '"');
    if (!end || end - q - 1 >= (long)sizeof question) return 2;
    memcpy(question, q + 1, end - q - 1);
    question[end - q - 1] = 0;
    const char *base = getenv("OPENAI_BASE_URL");
    if (!base || sscanf(base, "http://%255[^:]:%d%1023s", host, &port, path) != 3) return 2;
    if (call(question, 0, 0, buf, sizeof buf) || call(question, 1, 0, buf, sizeof buf) || call(question, 0, 1, buf, sizeof buf)) {
        fputs("a call failed\n", stderr);
        return 1;
    }
    char *c = strstr(buf, "\"content\":\"");
    if (!c) return 1;
    c += 11;
    char *e = strchr(c, '"');
    if (!e) return 1;
    fwrite(c, 1, e - c, stdout);
    putchar('\n');
    return 0;
}
