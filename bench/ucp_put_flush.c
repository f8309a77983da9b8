// UCX's own one-sided write with remote completion: ucp_put_nbx followed by ucp_ep_flush_nbx,
// the flush completing once the put has landed in the target's memory (what NIXL's UCX backend
// waits for, and what a symmem Work's completion means: the bytes are in the peer's memory).
// ucx_perftest's ucp_put_bw counts a put done once UCX has taken its bytes (local completion,
// one flush at the very end), so its small-message rate is not a like-for-like baseline for
// transfers each known to have landed; this is.
//
//   gcc -O2 -o target/bench/ucp_put_flush bench/ucp_put_flush.c -lucp -lucs
//   UCX_TLS=tcp target/bench/ucp_put_flush [BYTES] [WINDOW] [OPS]   (defaults 8, 8, 20000)
//
// Forks a target (which maps a buffer, packs its rkey and progresses its worker until told to
// stop) and an initiator, which connect over a socketpair, then prints one JSON line: the
// median round trip of one put+flush at a time (latency_us), and the rate with WINDOW of them in
// flight (stream_gbps, ops_per_s). Endpoints ask for peer-failure handling when PEER=1 (as
// symmem's do; UCX 1.13 then picks other lanes on tcp), none otherwise (as ucx_perftest's).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#define CHECK(x)                                                                  \
    do {                                                                          \
        ucs_status_t s_ = (x);                                                    \
        if (s_ != UCS_OK) {                                                       \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,             \
                    ucs_status_string(s_));                                       \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

static void put_all(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t k = write(fd, c, n);
        if (k <= 0) { perror("write"); exit(1); }
        c += k; n -= (size_t)k;
    }
}
static void get_all(int fd, void *p, size_t n) {
    char *c = p;
    while (n) {
        ssize_t k = read(fd, c, n);
        if (k <= 0) { perror("read"); exit(1); }
        c += k; n -= (size_t)k;
    }
}
static void send_blob(int fd, const void *p, size_t n) { uint64_t l = n; put_all(fd, &l, 8); put_all(fd, p, n); }
static void *recv_blob(int fd, size_t *n) {
    uint64_t l; get_all(fd, &l, 8);
    if (l > (1u << 20)) { fprintf(stderr, "blob too large\n"); exit(1); }
    void *p = malloc(l); get_all(fd, p, l); *n = l; return p;
}
static double now_us(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void setup(ucp_context_h *ctx, ucp_worker_h *w) {
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_RMA};
    ucp_config_t *cfg;
    CHECK(ucp_config_read(NULL, NULL, &cfg));
    CHECK(ucp_init(&p, cfg, ctx));
    ucp_config_release(cfg);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    CHECK(ucp_worker_create(*ctx, &wp, w));
}

// Waits for a request (or an immediate status) and frees it.
static void finish(ucp_worker_h w, ucs_status_ptr_t r) {
    if (r == NULL) return;
    if (UCS_PTR_IS_ERR(r)) { fprintf(stderr, "request: %s\n", ucs_status_string(UCS_PTR_STATUS(r))); exit(1); }
    ucs_status_t s;
    while ((s = ucp_request_check_status(r)) == UCS_INPROGRESS) ucp_worker_progress(w);
    ucp_request_free(r);
    if (s != UCS_OK) { fprintf(stderr, "request: %s\n", ucs_status_string(s)); exit(1); }
}

static void target(int fd, size_t bytes) {
    ucp_context_h ctx; ucp_worker_h w;
    setup(&ctx, &w);
    void *buf = calloc(1, bytes);
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                               .address = buf, .length = bytes};
    ucp_mem_h mem;
    CHECK(ucp_mem_map(ctx, &mp, &mem));
    void *rkey; size_t rlen;
    CHECK(ucp_rkey_pack(ctx, mem, &rkey, &rlen));
    ucp_address_t *addr; size_t alen;
    CHECK(ucp_worker_get_address(w, &addr, &alen));
    send_blob(fd, addr, alen);
    send_blob(fd, rkey, rlen);
    uint64_t where = (uintptr_t)buf;
    put_all(fd, &where, 8);
    // Progress until the initiator says it is done (one byte on the socketpair) or is gone,
    // looking at the socketpair only after 1024 progress calls in a row found nothing, so that
    // serving puts costs no system call of this loop's own.
    for (unsigned idle = 0;;) {
        if (ucp_worker_progress(w)) {
            idle = 0;
            continue;
        }
        char c;
        if (++idle % 1024 == 0 && recv(fd, &c, 1, MSG_DONTWAIT) >= 0) break;
    }
    ucp_rkey_buffer_release(rkey);
    ucp_worker_release_address(w, addr);
    ucp_mem_unmap(ctx, mem);
    ucp_worker_destroy(w);
    ucp_cleanup(ctx);
}

static void initiator(int fd, size_t bytes, int window, int ops) {
    ucp_context_h ctx; ucp_worker_h w;
    setup(&ctx, &w);
    size_t alen, rlen;
    void *addr = recv_blob(fd, &alen), *rbuf = recv_blob(fd, &rlen);
    uint64_t where; get_all(fd, &where, 8);
    int peer = getenv("PEER") && atoi(getenv("PEER"));
    ucp_ep_params_t ep_params = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                                 .address = addr,
                                 .err_mode = peer ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE};
    ucp_ep_h ep;
    CHECK(ucp_ep_create(w, &ep_params, &ep));
    ucp_rkey_h rkey;
    CHECK(ucp_ep_rkey_unpack(ep, rbuf, &rkey));
    char *src = malloc(bytes);
    memset(src, 7, bytes);
    ucp_request_param_t none = {.op_attr_mask = 0};
    // Latency: one put and its flush at a time.
    int lat_n = ops < 2000 ? ops : 2000;
    double *lat = malloc(sizeof(double) * (size_t)(lat_n + lat_n / 10));
    for (int i = 0; i < lat_n + lat_n / 10; i++) {
        double t = now_us();
        finish(w, ucp_put_nbx(ep, src, bytes, where, rkey, &none));
        finish(w, ucp_ep_flush_nbx(ep, &none));
        lat[i] = now_us() - t;
    }
    qsort(lat + lat_n / 10, (size_t)lat_n, sizeof(double), cmp);
    double median = lat[lat_n / 10 + lat_n / 2];
    // Rate: WINDOW put+flush pairs in flight; the oldest flush is waited for before the next.
    ucs_status_ptr_t *ring = calloc((size_t)window, sizeof(*ring));
    double t0 = now_us();
    for (int i = 0; i < ops; i++) {
        int slot = i % window;
        if (i >= window) finish(w, ring[slot]);
        ucs_status_ptr_t p = ucp_put_nbx(ep, src, bytes, where, rkey, &none);
        if (UCS_PTR_IS_PTR(p)) ucp_request_free(p); // its flush covers it
        else if (UCS_PTR_IS_ERR(p)) { fprintf(stderr, "put failed\n"); exit(1); }
        ring[slot] = ucp_ep_flush_nbx(ep, &none);
    }
    for (int i = ops > window ? ops - window : 0; i < ops; i++) finish(w, ring[i % window]);
    double d = now_us() - t0;
    printf("{\"bench\": \"ucp_put_flush\", \"size\": %zu, \"window\": %d, \"ops\": %d, \"err_mode\": \"%s\", "
           "\"latency_us\": %.3f, \"ops_per_s\": %.0f, \"stream_gbps\": %.6g}\n",
           bytes, window, ops, peer ? "peer" : "none", median, ops / d * 1e6, (double)ops * bytes / d / 1e3);
    fflush(stdout);
    ucp_rkey_destroy(rkey);
    free(ring);
    free(lat);
    free(src);
    free(rbuf);
    finish(w, ucp_ep_close_nbx(ep, &none)); // flushes, then closes
    char c = 1;
    put_all(fd, &c, 1);
    ucp_worker_destroy(w);
    ucp_cleanup(ctx);
    free(addr); // after the endpoint that was made from it is closed
}

int main(int argc, char **argv) {
    size_t bytes = argc > 1 ? strtoull(argv[1], NULL, 10) : 8;
    int window = argc > 2 ? atoi(argv[2]) : 8;
    int ops = argc > 3 ? atoi(argv[3]) : 20000;
    if (bytes == 0 || window <= 0 || ops <= 0) { fprintf(stderr, "BYTES, WINDOW and OPS must be positive\n"); return 2; }
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) { perror("socketpair"); return 1; }
    pid_t child = fork();
    if (child < 0) { perror("fork"); return 1; }
    if (child == 0) { close(sv[0]); target(sv[1], bytes); _exit(0); }
    close(sv[1]);
    initiator(sv[0], bytes, window, ops);
    int st;
    waitpid(child, &st, 0);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}
