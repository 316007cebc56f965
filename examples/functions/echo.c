/* echo: copies stdin to stdout. */
#include <stdio.h>

int main(void) {
  static char buf[1 << 20];
  size_t n = fread(buf, 1, sizeof buf, stdin);
  fwrite(buf, 1, n, stdout);
  return 0;
}
