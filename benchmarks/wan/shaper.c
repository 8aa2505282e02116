/* shaper: the WAN benchmark's userspace link emulator (this kernel has no sch_netem).
 *
 * A star router in one process. Every node (server, sites) lives in its own network
 * namespace with a TUN device; the shaper opens each TUN from inside its namespace
 * (setns + TUNSETIFF) and forwards IPv4 packets by destination address through two
 * stages: the sender's uplink, then the receiver's downlink. Each stage has a rate
 * (serialization), a one-way delay, random per-packet loss and a tail-drop queue of
 * QUEUE_MS at line rate (at least 64 KiB); a node whose link is down drops everything
 * to and from it, including packets already in flight.
 *
 * usage: shaper LINKS_FILE COUNTERS_FILE
 *   LINKS_FILE, one node a line (written by benchmarks/wan/links.py):
 *     NAME NETNS TUN IPV4 UP_KBIT DOWN_KBIT DELAY_MS LOSS_PCT UP   (kbit 0: unlimited)
 *   SIGHUP re-reads it (rates, delay, loss, up/down; nodes are fixed at start).
 *   COUNTERS_FILE is rewritten (atomically) every 50 ms, one node a line:
 *     NAME SENT_BYTES RECEIVED_BYTES DROP_LOSS DROP_QUEUE DROP_DOWN
 *   so the benchmark can act on the bytes a node has moved (e.g. cut mid-upload).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#define MAX_NODES 16
#define QUEUE_MS 100.0
#define MIN_QUEUE_BYTES 65536.0
#define COUNTERS_EVERY_NS 50000000LL

typedef struct packet {
  struct packet *next;
  int64_t due; /* when it leaves this stage (serialized + propagated) */
  int to;
  int len;
  unsigned char bytes[];
} packet;

typedef struct {
  packet *head, *tail;
  int64_t free_at; /* when the stage's transmitter finishes its last packet */
} stage;

typedef struct {
  char name[32], netns[64], tun[IFNAMSIZ];
  uint32_t addr;
  double up_kbit, down_kbit, delay_ms, loss;
  int up;
  int fd;
  stage uplink, downlink;
  unsigned long long sent, received, drop_loss, drop_queue, drop_down;
} node;

static node nodes[MAX_NODES];
static int num_nodes;
static const char *links_path, *counters_path;
static volatile sig_atomic_t reload_wanted, stop_wanted;
static uint64_t rng = 0x9e3779b97f4a7c15ULL;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static double uniform(void) { /* xorshift64*: fixed seed, so losses repeat run to run */
  rng ^= rng >> 12; rng ^= rng << 25; rng ^= rng >> 27;
  return (double)((rng * 2685821657736338717ULL) >> 11) / 9007199254740992.0;
}

static int read_links(int first) {
  FILE *f = fopen(links_path, "r");
  if (!f) { perror(links_path); return -1; }
  char line[512];
  int seen = 0;
  while (fgets(line, sizeof line, f)) {
    if (line[0] == '#' || line[0] == '\n') continue;
    char name[32], netns[64], tun[IFNAMSIZ], addr[32];
    double up_kbit, down_kbit, delay_ms, loss_pct;
    int up;
    if (sscanf(line, "%31s %63s %15s %31s %lf %lf %lf %lf %d", name, netns, tun, addr, &up_kbit,
               &down_kbit, &delay_ms, &loss_pct, &up) != 9) {
      fprintf(stderr, "shaper: bad line in %s: %s", links_path, line);
      fclose(f);
      return -1;
    }
    node *n = NULL;
    if (first) {
      if (num_nodes == MAX_NODES) { fprintf(stderr, "shaper: more than %d nodes\n", MAX_NODES); fclose(f); return -1; }
      n = &nodes[num_nodes++];
      memset(n, 0, sizeof *n);
      snprintf(n->name, sizeof n->name, "%s", name);
      snprintf(n->netns, sizeof n->netns, "%s", netns);
      snprintf(n->tun, sizeof n->tun, "%s", tun);
      if (inet_pton(AF_INET, addr, &n->addr) != 1) { fprintf(stderr, "shaper: bad address %s\n", addr); fclose(f); return -1; }
      n->fd = -1;
    } else {
      for (int i = 0; i < num_nodes; i++)
        if (!strcmp(nodes[i].name, name)) n = &nodes[i];
      if (!n) { fprintf(stderr, "shaper: unknown node %s ignored (nodes are fixed at start)\n", name); continue; }
    }
    n->up_kbit = up_kbit; n->down_kbit = down_kbit; n->delay_ms = delay_ms;
    n->loss = loss_pct / 100.0; n->up = up;
    seen++;
  }
  fclose(f);
  for (int i = 0; i < num_nodes; i++) {
    node *n = &nodes[i];
    fprintf(stderr, "shaper: %s up %g kbit/s down %g kbit/s delay %g ms loss %g%% %s\n", n->name,
            n->up_kbit, n->down_kbit, n->delay_ms, n->loss * 100, n->up ? "up" : "DOWN");
  }
  return seen;
}

static int open_tun(node *n) {
  char path[128];
  snprintf(path, sizeof path, "/var/run/netns/%s", n->netns);
  int ns = open(path, O_RDONLY | O_CLOEXEC);
  if (ns < 0) { perror(path); return -1; }
  if (setns(ns, CLONE_NEWNET) < 0) { perror("setns"); close(ns); return -1; }
  close(ns);
  int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) { perror("/dev/net/tun"); return -1; }
  struct ifreq ifr;
  memset(&ifr, 0, sizeof ifr);
  ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
  snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "%s", n->tun);
  if (ioctl(fd, TUNSETIFF, &ifr) < 0) { perror("TUNSETIFF"); close(fd); return -1; }
  n->fd = fd;
  return 0;
}

static void enqueue(stage *s, packet *p) {
  p->next = NULL;
  if (s->tail) s->tail->next = p; else s->head = p;
  s->tail = p;
}

static packet *dequeue(stage *s) {
  packet *p = s->head;
  if (p) { s->head = p->next; if (!s->head) s->tail = NULL; }
  return p;
}

/* Time the packet finishes serializing on a stage it reaches at `t`, or -1 when the
 * stage's queue already holds more than its limit (tail drop). */
static int64_t transmit(stage *s, double kbit, int64_t t, int len) {
  if (kbit <= 0) return t;
  double ns_per_byte = 8.0 / (kbit * 1000.0) * 1e9;
  double limit_ns = QUEUE_MS * 1e6;
  if (MIN_QUEUE_BYTES * ns_per_byte > limit_ns) limit_ns = MIN_QUEUE_BYTES * ns_per_byte;
  int64_t start = s->free_at > t ? s->free_at : t;
  if ((double)(start - t) > limit_ns) return -1;
  s->free_at = start + (int64_t)(len * ns_per_byte);
  return s->free_at;
}

static void write_counters(void) {
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp", counters_path);
  FILE *f = fopen(tmp, "w");
  if (!f) return;
  for (int i = 0; i < num_nodes; i++) {
    node *n = &nodes[i];
    fprintf(f, "%s %llu %llu %llu %llu %llu\n", n->name, n->sent, n->received, n->drop_loss,
            n->drop_queue, n->drop_down);
  }
  fclose(f);
  rename(tmp, counters_path);
}

static void on_signal(int sig) {
  if (sig == SIGHUP) reload_wanted = 1; else stop_wanted = 1;
}

static int route(uint32_t addr) {
  for (int i = 0; i < num_nodes; i++)
    if (nodes[i].addr == addr) return i;
  return -1;
}

int main(int argc, char **argv) {
  if (argc != 3) { fprintf(stderr, "usage: shaper LINKS_FILE COUNTERS_FILE\n"); return 2; }
  links_path = argv[1];
  counters_path = argv[2];
  if (read_links(1) <= 0) return 1;
  for (int i = 0; i < num_nodes; i++)
    if (open_tun(&nodes[i]) < 0) return 1;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigaction(SIGHUP, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  struct pollfd fds[MAX_NODES];
  for (int i = 0; i < num_nodes; i++) { fds[i].fd = nodes[i].fd; fds[i].events = POLLIN; }
  static unsigned char buf[65536];
  int64_t next_counters = 0;
  write_counters();
  fprintf(stderr, "shaper: ready\n");
  while (!stop_wanted) {
    if (reload_wanted) { reload_wanted = 0; read_links(0); }
    int64_t now = now_ns();
    /* 1. packets the nodes sent: into the sender's uplink */
    for (int i = 0; i < num_nodes; i++) {
      node *from = &nodes[i];
      for (int burst = 0; burst < 512; burst++) {
        ssize_t len = read(from->fd, buf, sizeof buf);
        if (len <= 0) break;
        if (len < 20 || (buf[0] >> 4) != 4) continue; /* IPv4 only */
        from->sent += (unsigned long long)len;
        uint32_t dst;
        memcpy(&dst, buf + 16, 4);
        int to = route(dst);
        if (to < 0 || to == i) continue;
        if (!from->up) { from->drop_down++; continue; }
        if (from->loss > 0 && uniform() < from->loss) { from->drop_loss++; continue; }
        int64_t done = transmit(&from->uplink, from->up_kbit, now, (int)len);
        if (done < 0) { from->drop_queue++; continue; }
        packet *p = malloc(sizeof(packet) + (size_t)len);
        if (!p) continue;
        p->len = (int)len; p->to = to; p->due = done + (int64_t)(from->delay_ms * 1e6);
        memcpy(p->bytes, buf, (size_t)len);
        enqueue(&from->uplink, p);
      }
    }
    /* 2. packets that crossed an uplink: into the receiver's downlink, oldest first */
    for (;;) {
      int best = -1;
      for (int i = 0; i < num_nodes; i++) {
        packet *h = nodes[i].uplink.head;
        if (h && h->due <= now && (best < 0 || h->due < nodes[best].uplink.head->due)) best = i;
      }
      if (best < 0) break;
      node *from = &nodes[best];
      packet *p = dequeue(&from->uplink);
      node *to = &nodes[p->to];
      if (!from->up) { from->drop_down++; free(p); continue; }
      if (!to->up) { to->drop_down++; free(p); continue; }
      if (to->loss > 0 && uniform() < to->loss) { to->drop_loss++; free(p); continue; }
      int64_t done = transmit(&to->downlink, to->down_kbit, p->due, p->len);
      if (done < 0) { to->drop_queue++; free(p); continue; }
      p->due = done + (int64_t)(to->delay_ms * 1e6);
      enqueue(&to->downlink, p);
    }
    /* 3. packets that crossed a downlink: delivered to the receiver */
    for (int i = 0; i < num_nodes; i++) {
      node *to = &nodes[i];
      while (to->downlink.head && to->downlink.head->due <= now) {
        packet *p = dequeue(&to->downlink);
        if (!to->up) to->drop_down++;
        else if (write(to->fd, p->bytes, (size_t)p->len) == p->len) to->received += (unsigned long long)p->len;
        free(p);
      }
    }
    if (now >= next_counters) { write_counters(); next_counters = now + COUNTERS_EVERY_NS; }
    /* 4. sleep until the next packet is due, a packet arrives, or counters are due */
    int64_t wake = next_counters;
    for (int i = 0; i < num_nodes; i++) {
      if (nodes[i].uplink.head && nodes[i].uplink.head->due < wake) wake = nodes[i].uplink.head->due;
      if (nodes[i].downlink.head && nodes[i].downlink.head->due < wake) wake = nodes[i].downlink.head->due;
    }
    int64_t wait = wake - now_ns();
    if (wait < 0) wait = 0;
    struct timespec ts = {wait / 1000000000LL, wait % 1000000000LL};
    ppoll(fds, (nfds_t)num_nodes, &ts, NULL);
  }
  write_counters();
  return 0;
}
