// The floor of a small cross-host exchange on this machine: two processes send each other an
// N-byte message at the same time over loopback TCP and busy-poll for the other's, as a 2-rank
// all-reduce across played hosts does, over one connection used both ways (as Open MPI's tcp
// btl does) or over two, one per direction (as symmem's tcp links do: each rank's requests go
// out on the connection it opened to its peer's listener).
//
//   gcc -O2 -o target/bench/tcp_exchange bench/tcp_exchange.c
//   target/bench/tcp_exchange [BYTES] [ITERS]     (defaults: 216, the 2-rank 8-byte
//                                                  all-reduce's batch; 20000)
//
// Prints the median time of one exchange for each way, and of its two system calls: the write,
// and the recv that finds the peer's bytes (the busy-polling recvs that find nothing are left
// out). Here, with one connection each message carries the acknowledgement of the other's;
// with two, each costs a bare acknowledgement back (`nstat TcpOutSegs`: twice the messages),
// and the recv that finds the bytes is where the time goes: 2.3 us on two connections, 0.5 us
// on one (write 1.7-2.1 and 2.2 us; exchange 4.1 and 2.9 us; 2026-12-03). symmem's links are
// not this plain loop: in its 2-rank 8-byte all-reduce the kernel sends about 1.5 segments per
// message, not 2, and the look that serves the peer's message spends 2.3-2.4 us in that recv.
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void check(int ok, const char *what) {
    if (!ok) {
        perror(what);
        exit(1);
    }
}

static int listener(int *port) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    check(s >= 0 && bind(s, (void *)&a, sizeof a) == 0 && listen(s, 4) == 0, "listen");
    check(getsockname(s, (void *)&a, &l) == 0, "getsockname");
    *port = ntohs(a.sin_port);
    return s;
}

static int dial(int port) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {
        .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    check(s >= 0 && connect(s, (void *)&a, sizeof a) == 0, "connect");
    return s;
}

static void fast(int s) {
    int one = 1;
    check(setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) == 0, "TCP_NODELAY");
    check(fcntl(s, F_SETFL, O_NONBLOCK) == 0, "O_NONBLOCK");
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// One run: `both_ways` one connection, else one per direction. The parent prints the median.
static void run(int both_ways, int len, int iters) {
    int p1, p2, l1 = listener(&p1), l2 = listener(&p2), tx, rx;
    fflush(stdout);
    pid_t child = fork();
    check(child >= 0, "fork");
    if (both_ways) {
        tx = rx = child == 0 ? dial(p1) : accept(l1, 0, 0);
    } else if (child == 0) {
        tx = dial(p1);
        rx = accept(l2, 0, 0);
    } else {
        rx = accept(l1, 0, 0);
        tx = dial(p2);
    }
    check(tx >= 0 && rx >= 0, "accept");
    fast(tx);
    fast(rx);
    char *buf = malloc(len);
    double *lat = malloc(sizeof(double) * iters), *wrote = malloc(sizeof(double) * iters),
           *took = malloc(sizeof(double) * iters);
    check(buf && lat && wrote && took, "malloc");
    memset(buf, 1, len);
    for (int i = 0; i < iters; i++) {
        double t = now_us();
        for (int sent = 0; sent < len;) {
            ssize_t k = write(tx, buf + sent, len - sent);
            if (k > 0) sent += k;
            else check(k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK), "write");
        }
        wrote[i] = now_us() - t;
        took[i] = 0;
        for (int got = 0; got < len;) {
            double r = now_us();
            ssize_t k = recv(rx, buf + got, len - got, 0);
            if (k > 0) got += k, took[i] += now_us() - r;
            else if (k == 0) {
                fprintf(stderr, "recv: the other process closed its end\n");
                exit(1);
            }
            else check(errno == EAGAIN || errno == EWOULDBLOCK, "recv");
        }
        lat[i] = now_us() - t;
    }
    if (child == 0) _exit(0);
    waitpid(child, 0, 0);
    qsort(lat, iters, sizeof(double), by_value);
    qsort(wrote, iters, sizeof(double), by_value);
    qsort(took, iters, sizeof(double), by_value);
    const char *how = both_ways ? "one connection, both ways" : "two connections, one each way";
    printf("%-29s %6d bytes  median %7.2f us  (write %5.2f, the recv that finds the bytes %5.2f)\n", how, len,
           lat[iters / 2], wrote[iters / 2], took[iters / 2]);
    close(l1), close(l2), close(tx);
    if (rx != tx) close(rx);
    free(buf), free(lat), free(wrote), free(took);
}

int main(int argc, char **argv) {
    int len = argc > 1 ? atoi(argv[1]) : 216, iters = argc > 2 ? atoi(argv[2]) : 20000;
    if (len <= 0 || iters <= 0) {
        fprintf(stderr, "usage: %s [BYTES>0] [ITERS>0]\n", argv[0]);
        return 2;
    }
    for (int round = 0; round < 3; round++) {
        run(1, len, iters);
        run(0, len, iters);
    }
    return 0;
}
