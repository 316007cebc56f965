// A tiny typed event emitter (no dependency, works in browsers and Node).

// eslint-disable-next-line @typescript-eslint/no-explicit-any
type Listener = (arg: any) => void;

export class Emitter<Events extends Record<string, unknown>> {
  private listeners = new Map<keyof Events, Set<Listener>>();

  /** Adds a listener; returns a function that removes it. */
  on<K extends keyof Events>(event: K, fn: (arg: Events[K]) => void): () => void {
    let set = this.listeners.get(event);
    if (!set) this.listeners.set(event, (set = new Set()));
    set.add(fn);
    return () => this.off(event, fn);
  }

  /** Adds a listener called once. */
  once<K extends keyof Events>(event: K, fn: (arg: Events[K]) => void): () => void {
    const off = this.on(event, (a) => {
      off();
      fn(a);
    });
    return off;
  }

  off<K extends keyof Events>(event: K, fn: (arg: Events[K]) => void): void {
    this.listeners.get(event)?.delete(fn);
  }

  protected emit<K extends keyof Events>(event: K, arg: Events[K]): void {
    const set = this.listeners.get(event);
    if (!set) return;
    for (const fn of [...set]) {
      try {
        fn(arg);
      } catch (e) {
        // A listener's bug must not break the client's state machine.
        setTimeout(() => {
          throw e;
        });
      }
    }
  }
}
